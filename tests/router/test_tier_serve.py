"""Against a real `kvroute serve` process: bridges on loopback report what three workers hold
(w0 nothing of the prompts, w1 both prompts in its CPU tier, w2 prompt A on GPU); the router
prices CPU tokens as a transfer, so w1 beats the cold worker and loses to the GPU copy, and
`/admin/score` and `/admin/decisions` show the tokens per tier."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.instant_engine import running_engine
from kvroute.proto import events_pb2
from kvroute.testbed.procs import free_port
from tests.router.test_events import FakeBridge

OP = events_pb2.KvGroupEvent
ROOT = Path(__file__).resolve().parents[2]
ADMIN = "tier-test-admin"
N_BLOCKS, CHUNK = 64, 4  # 16-token GPU blocks; offloaded in chunks of 4 blocks
PROMPTS = {
    "a": list(range(10_000, 10_000 + 16 * N_BLOCKS + 1)),
    "b": list(range(30_000, 30_000 + 16 * N_BLOCKS + 1)),
}
TAGS = {"a": 1, "b": 2, "other": 3}


def h(tag: int, i: int) -> bytes:
    return (tag << 32 | i).to_bytes(8, "big")


def blocks(prompt: str, first: int, count: int, tier: int = events_pb2.Tier.GPU) -> Any:
    tag, tokens = TAGS[prompt], PROMPTS.get(prompt, list(range(50_000, 50_000 + 16 * 64)))
    return OP(
        operation=OP.STORE,
        block_hashes=[h(tag, first + i + 1) for i in range(count)],
        parent_block_hash=h(tag, first) if first else b"",
        token_ids=tokens[16 * first : 16 * (first + count)],
        block_size=16,
        kind="full_attention",
        tier=tier,
    )


def held(name: str) -> events_pb2.KvEventBatch:
    """What worker `name` reports: every worker has one unrelated GPU block (its layout)."""
    batch = events_pb2.KvEventBatch(sequence=1, events=[blocks("other", 0, 1)])
    if name == "w1":
        for prompt in ("a", "b"):
            batch.tier_events.extend(
                blocks(prompt, c, CHUNK, events_pb2.Tier.CPU) for c in range(0, N_BLOCKS, CHUNK)
            )
    if name == "w2":
        batch.events.append(blocks("a", 0, N_BLOCKS))
    return batch


@contextlib.asynccontextmanager
async def tier_router(
    engine_url: str, cfg_path: Path, policy: dict[str, Any] | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    """The bridges and a `kvroute serve` in front of the three workers, every worker's
    events live, with the `policy` settings given; yields a client of the router (admin
    headers set)."""
    bridges = {name: FakeBridge() for name in ("w0", "w1", "w2")}
    for name, bridge in bridges.items():
        await bridge.start()
        bridge.stream.apply(held(name))
    port = free_port()
    cfg_path.write_text(
        yaml.safe_dump(
            {
                "host": "127.0.0.1",
                "port": port,
                "log_level": "warning",
                "models": {"m": {"tokenizer": "request"}},
                "policy": policy or {},
                "workers": [
                    {"name": n, "url": engine_url, "model": "m", "bridge": f"127.0.0.1:{b.port}"}
                    for n, b in bridges.items()
                ],
            }
        )
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVROUTE_ADMIN__TOKEN": ADMIN}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvroute", "serve", "--config", str(cfg_path), env=env
    )
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}",
            timeout=10,
            headers={"authorization": f"Bearer {ADMIN}"},
        ) as http:
            deadline = asyncio.get_running_loop().time() + 60
            while True:  # until the router is up and every worker's events are live
                try:
                    by = await score(http, "a")
                    if len(by) == 3 and all(w.get("events_live") for w in by.values()):
                        break
                except (httpx.HTTPError, AssertionError):
                    pass
                assert proc.returncode is None, "kvroute serve exited"
                assert asyncio.get_running_loop().time() < deadline, "router never went live"
                await asyncio.sleep(0.2)
            yield http
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        for bridge in bridges.values():
            await bridge.stop()


async def score(http: httpx.AsyncClient, prompt: str, answer: dict[str, Any] | None = None) -> Any:
    """POST /admin/score for a prompt: its workers by name (the whole answer into `answer`)."""
    resp = await http.post(
        "/admin/score?endpoint=/v1/completions",
        json={"model": "m", "prompt": PROMPTS[prompt], "max_tokens": 1},
    )
    assert resp.status_code == 200, resp.text
    got: dict[str, Any] = resp.json()
    if answer is not None:
        answer.update(got)
    return {w["worker"]: w for w in got["workers"]}


async def scenario(engine_url: str, cfg_path: Path) -> None:
    async with tier_router(engine_url, cfg_path) as http:
        n = len(PROMPTS["a"])
        got: dict[str, Any] = {}
        by = await score(http, "a", got)
        assert by["w2"]["tier_tokens"] == {"gpu": n - 1, "cpu": 0, "storage": 0, "prefill": 1}
        assert by["w1"]["tier_tokens"] == {"gpu": 0, "cpu": n - 1, "storage": 0, "prefill": 1}
        assert by["w0"]["tier_tokens"] == {"gpu": 0, "cpu": 0, "storage": 0, "prefill": n}
        assert by["w1"]["terms"]["tier_load"] > 0 and by["w2"]["terms"]["tier_load"] == 0
        # the CPU copy beats the cold worker and loses to the GPU copy
        assert by["w2"]["est_ttft_s"] < by["w1"]["est_ttft_s"] < by["w0"]["est_ttft_s"]
        assert got["chosen"] == "w2"

        by = await score(http, "b", got)  # only w1 holds B, in its CPU tier
        assert got["chosen"] == "w1" and got["reason"] == "cache", got["detail"]
        assert by["w1"]["est_ttft_s"] < min(by["w0"]["est_ttft_s"], by["w2"]["est_ttft_s"])

        # a routed request: its decision keeps the tokens per tier
        resp = await http.post(
            "/v1/completions", json={"model": "m", "prompt": PROMPTS["b"], "max_tokens": 1}
        )
        assert resp.status_code == 200, resp.text
        last = (await http.get("/admin/decisions")).json()["decisions"][-1]
        assert last["chosen"] == "w1" and last["predicted_cached_tokens"] == n - 1
        cands = {c["worker"]: c for c in last["candidates"]}
        assert cands["w1"]["tier_tokens"]["cpu"] == n - 1


def test_a_cpu_copy_beats_a_cold_worker_and_loses_to_a_gpu_copy(tmp_path: Path) -> None:
    with running_engine() as engine:
        asyncio.run(asyncio.wait_for(scenario(engine, tmp_path / "router.yaml"), 120))
