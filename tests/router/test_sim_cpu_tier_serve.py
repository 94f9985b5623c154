"""Real processes on loopback: `kvroute sim fleet` (two simulated engines with a CPU tier, each
with its bridge) and `kvroute serve` in front of them. A prompt pushed out of one engine's small
GPU pool by others is still in that engine's CPU tier: `/admin/score` credits those tokens as
CPU tokens on that worker, exactly as many as the engine reports when the request is sent, and
a router started after the engine offloaded them (which learns the tier from its bridge's
snapshot) credits as many as one that followed the offload live."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvroute.testbed.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "cpu-tier-test-admin"
MODEL = "kvroute-sim"
PROMPTS = {name: list(range(base, base + 600)) for name, base in (("a", 1000), ("b", 2000))}
PROMPTS["c"] = list(range(3000, 3600))
PROMPTS["a2"] = PROMPTS["a"][:400] + list(range(3700, 3900))  # leaves a within its 7th chunk


def _start_fleet(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    cmd = [
        sys.executable, "-m", "kvroute", "sim", "fleet", "--workers", "2", "--speed", "20",
        "--num-blocks", "80", "--max-model-len", "1024", "--cpu-offload-gib", "1",
        "--config-out", str(tmp_path / "fleet.yaml"), *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline()
            if line.startswith("{") and json.loads(line).get("fleet_ready"):
                return proc, json.loads(line)
        assert proc.poll() is None, f"fleet exited with {proc.returncode}"
    proc.kill()
    raise AssertionError("fleet did not become ready")


def _start_router(
    tmp_path: Path, name: str = "router", **settings: Any
) -> tuple[subprocess.Popen[bytes], str]:
    config = yaml.safe_load((tmp_path / "fleet.yaml").read_text())
    port = free_port()
    config.update(host="127.0.0.1", port=port, log_level="warning", **settings)
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVROUTE_ADMIN__TOKEN": ADMIN}
    cmd = [sys.executable, "-m", "kvroute", "serve", "--config", str(tmp_path / f"{name}.yaml")]
    return subprocess.Popen(cmd, env=env), f"http://127.0.0.1:{port}"


def _admin(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=10, headers={"authorization": f"Bearer {ADMIN}"})


def _all_live(router: httpx.Client) -> bool:
    return all(w["events_live"] for w in _score(router, "a")[1].values())


def _stop(*procs: subprocess.Popen[Any]) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _score(router: httpx.Client, prompt: str) -> tuple[dict[str, Any], dict[str, Any]]:
    resp = router.post(
        "/admin/score?endpoint=/v1/completions",
        json={"model": MODEL, "prompt": PROMPTS[prompt], "max_tokens": 1},
    )
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer, {w["worker"]: w for w in answer["workers"]}


def _until(check: Any, what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = check()
            if got:
                return got
        except (httpx.HTTPError, AssertionError, KeyError):
            pass
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _complete(url: str, prompt: str) -> dict[str, Any]:
    resp = httpx.post(
        f"{url}/v1/completions",
        json={"model": MODEL, "prompt": PROMPTS[prompt], "max_tokens": 1},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    usage: dict[str, Any] = resp.json()["usage"]
    return usage


def _cached_by_source(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:prompt_tokens_cached_by_source_total{"):
            source = line.split('source="')[1].split('"')[0]
            out[source] = float(line.rsplit(" ", 1)[1])
    return out


def _probe(worker_url: str, prompt: str) -> tuple[int, int]:
    """The engine's own answer for a prompt now: (GPU tokens, GPU + CPU tokens)."""
    body = {"model": MODEL, "prompt_token_ids": PROMPTS[prompt]}
    probe = httpx.post(f"{worker_url}/sim/probe", json=body).json()
    (gpu,) = probe["per_group"]  # the GPU alone
    return gpu, probe["cached_tokens"]


def test_the_router_credits_a_sim_engines_cpu_tier(tmp_path: Path) -> None:
    fleet, info = _start_fleet(tmp_path)
    router_proc, router_url = _start_router(tmp_path)
    try:
        w0, w1 = info["workers"]
        with _admin(router_url) as router:
            _until(lambda: _all_live(router), "the router never saw both workers' events live")
            # a on w0, then b and c push most of a out of w0's GPU pool (80 blocks)
            for prompt in ("a", "b", "c"):
                assert _complete(w0["url"], prompt)["prompt_tokens_details"]["cached_tokens"] == 0
            gpu, cached = _probe(w0["url"], "a")
            assert gpu < 200 and cached == 592  # the CPU tier holds the rest

            def credited() -> dict[str, Any] | None:
                answer, by = _score(router, "a")
                return answer if by[w0["name"]]["tier_tokens"]["cpu"] else None

            answer = _until(credited, "the router never credited w0's CPU tier")
            by = {w["worker"]: w for w in answer["workers"]}
            assert by[w0["name"]]["tier_tokens"] == {
                "gpu": gpu, "cpu": 592 - gpu, "storage": 0, "prefill": 8,
            }  # fmt: skip
            assert by[w0["name"]]["terms"]["tier_load"] > 0
            assert by[w1["name"]]["tier_tokens"]["cpu"] == 0
            assert answer["chosen"] == w0["name"]

            # the routed request lands on w0, which loads the tokens the router predicted
            before = _cached_by_source(w0["url"])
            resp = router.post(
                "/v1/completions", json={"model": MODEL, "prompt": PROMPTS["a"], "max_tokens": 1}
            )
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 592
            after = _cached_by_source(w0["url"])
            assert after["host"] - before["host"] == 592 - gpu
            assert after["device"] - before["device"] == gpu
    finally:
        _stop(router_proc, fleet)


def test_a_router_started_after_the_offload_credits_the_cpu_tier_as_an_early_one(
    tmp_path: Path,
) -> None:
    # vLLM's offloading groups GPU blocks into chunks: here 4 blocks of 16 tokens each
    fleet, info = _start_fleet(tmp_path, "--cpu-offload-chunk-blocks", "4")
    procs: list[subprocess.Popen[Any]] = [fleet]
    try:
        early_proc, early_url = _start_router(tmp_path, "early")
        procs.insert(0, early_proc)
        w0 = info["workers"][0]
        with _admin(early_url) as early:
            _until(lambda: _all_live(early), "the early router never saw the events live")
            for prompt in ("a", "b", "c"):  # b and c push most of a out of w0's GPU pool
                assert _complete(w0["url"], prompt)["prompt_tokens_details"]["cached_tokens"] == 0
            engine = {prompt: _probe(w0["url"], prompt) for prompt in ("a", "a2")}
            gpu, cached = engine["a"]
            # the CPU tier holds a's 9 whole chunks, the GPU less than 5 of them
            assert gpu < 320 and cached == 576 and engine["a2"] == (gpu, 384)

            def tiers(router: httpx.Client, prompt: str) -> dict[str, int]:
                return dict(_score(router, prompt)[1][w0["name"]]["tier_tokens"])

            def expected(prompt: str) -> dict[str, int]:
                gpu, cached = engine[prompt]
                n = len(PROMPTS[prompt])
                return {"gpu": gpu, "cpu": cached - gpu, "storage": 0, "prefill": n - cached}

            for prompt in ("a", "a2"):
                _until(
                    lambda p=prompt: tiers(early, p) == expected(p),
                    f"the early router never credited w0's CPU tier for {prompt}",
                )
            # a router subscribing now learns the tier, and its chunk, from the snapshots
            late_proc, late_url = _start_router(tmp_path, "late")
            procs.insert(0, late_proc)
            with _admin(late_url) as late:
                _until(lambda: _all_live(late), "the late router never saw the events live")
                for prompt in ("a", "a2"):
                    assert tiers(late, prompt) == tiers(early, prompt) == expected(prompt)
                    assert _score(late, prompt)[0]["chosen"] == w0["name"]
    finally:
        _stop(*procs)


def test_the_router_learns_a_sim_engines_cpu_tier_rate(tmp_path: Path) -> None:
    """With `policy.learn_cpu_tier_rate`, the rate the router prices w0's CPU tokens at moves
    from the configured 200k tokens/s to what the engine's loads take: 2.1 Gbit/s at 128 KiB
    per token is 2,003 tokens/s of modelled time, 40,054 of wall time at speed 20 (the
    engine's load seconds are wall seconds, as vLLM's are measured ones)."""
    fleet, info = _start_fleet(tmp_path, "--cpu-offload-gbps", "2.1")
    modelled = 2.1e9 / 8 / 131072 * 20
    procs: list[subprocess.Popen[Any]] = [fleet]
    try:
        router_proc, router_url = _start_router(
            tmp_path,
            policy={"learn_cpu_tier_rate": True},
            load={"metrics_interval_s": 0.2, "metrics_max_interval_s": 0.2},
        )
        procs.insert(0, router_proc)
        w0 = info["workers"][0]
        with _admin(router_url) as router:
            _until(lambda: _all_live(router), "the router never saw the events live")

            def learned() -> float | None:
                worker = router.get(f"/admin/workers/{w0['name']}").json()
                value: float | None = worker["load"]["cpu_tier_tokens_per_s_learned"]
                return value

            assert learned() is None
            host = 0
            for _ in range(6):  # each a after b and c is loaded from w0's CPU tier
                for prompt in ("a", "b", "c"):
                    usage = _complete(w0["url"], prompt)
                    host += prompt == "a" and usage["prompt_tokens_details"]["cached_tokens"]
                time.sleep(0.5)  # a scrape or two between loads
            assert host > 2048
            got = _until(
                lambda: (v := learned()) is not None and abs(v - modelled) < 0.05 * modelled and v,
                f"the learned rate never came near {modelled:.0f} tokens/s",
            )
            # the router prices w0's CPU tokens at it
            by = _score(router, "a")[1]
            cpu = by[w0["name"]]["tier_tokens"]["cpu"]
            assert cpu > 0
            print(f"learned {got:.0f} tokens/s, modelled {modelled:.0f}")
            tier_load = by[w0["name"]]["terms"]["tier_load"]
            assert tier_load == pytest.approx(cpu / got, rel=0.05)
            # and shows that rate as learned where operators look
            load = router.get(f"/admin/workers/{w0['name']}").json()["load"]
            assert load["cpu_tier_tokens_per_s"] == pytest.approx(got, rel=0.05)
            label = f'{{worker="{w0["name"]}"}}'
            assert f"kvroute_worker_cpu_tier_rate_learned{label} 1.0" in router.get("/metrics").text
    finally:
        _stop(*procs)
