"""Several router replicas in front of one fleet (real `kvroute sim`, `kvroute bridge` and
`kvroute serve` processes on loopback): they build the same index from the same events, make
the same cache decisions, agree on session affinity, and see each other's load through the
engines' /metrics."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.loopback import Loopback, Router
from bench.traffic import (
    completion_body,
    eventually,
    post_json,
    predictions,
    score,
    session,
    stream,
    workers,
)
from kvroute.router.config import BreakerConfig, PolicyConfig, WorkerSpec
from kvroute.router.fleet.load import LoadTicket
from kvroute.router.fleet.workers import WorkerRegistry
from kvroute.router.routing.policy import CACHE, SESSION, LoadModel, RouteInput, make_policy
from tests.reliability.workload import documents, shared_prefix_prompts

ROOT = Path(__file__).resolve().parents[2]


async def _same_events(http: aiohttp.ClientSession, a: Router, b: Router) -> bool:
    """Both replicas live on every worker at the same sequence."""
    wa, wb = await workers(http, a.url), await workers(http, b.url)
    for name, w in wa.items():
        ea, eb = w["events"], wb[name]["events"]
        if ea["state"] != "live" or eb["state"] != "live":
            return False
        if ea["last_sequence"] != eb["last_sequence"]:
            return False
    return True


def _comparable(scored: dict[str, Any]) -> tuple[Any, ...]:
    """What two replicas must agree on for one body."""
    chosen = scored["chosen"] if scored["reason"] != "least_load" else None
    return (scored["reason"], chosen, predictions(scored), scored["prompt_tokens"])


@pytest.mark.timeout(90)
def test_two_replicas_agree_on_a_replayed_workload() -> None:
    async def main(lb: Loopback) -> None:
        engines = lb.engines(3, "--speed", "300", "--model-profile", "swa")
        bridges = lb.bridges(engines)
        # expectations (a replica's hint about what it just sent) last 1 s here
        config = lb.router_config(engines, bridges, policy={"expect_seconds": 1.0})
        a = lb.router(config, "router-a")
        prompts = shared_prefix_prompts(seed=7, docs=6, per_doc=4)
        async with session() as http:
            first = [completion_body(p, max_tokens=4) for p in prompts[: len(prompts) // 2]]
            await asyncio.gather(*(post_json(http, a.url + "/v1/completions", b) for b in first))
            # a replica that joins late learns the fleet from snapshots
            b = lb.router(config, "router-b")
            rest = [completion_body(p, max_tokens=4) for p in prompts[len(prompts) // 2 :]]
            answers = await asyncio.gather(
                *(post_json(http, b.url + "/v1/completions", body) for body in rest)
            )
            assert all(status == 200 for status, _, _ in answers)

            await eventually(lambda: _same_events(http, a, b), timeout=20)
            await asyncio.sleep(1.2)  # expectations of either replica have expired

            probes: list[dict[str, Any]] = []
            for p in prompts:
                probes.append(completion_body(p))
                probes.append(completion_body(p + " and a follow-up question"))
                probes.append(completion_body(p[: len(p) // 2]))
                probes.append(completion_body(p, cache_salt="tenant-x"))
            for i, doc in enumerate(documents(seed=99, n=8)):
                probes.append(completion_body(doc, user=f"session-{i}"))  # cold: affinity
            reasons = set()
            for body in probes:
                sa, sb = await score(http, a.url, body), await score(http, b.url, body)
                assert _comparable(sa) == _comparable(sb), (body, sa, sb)
                reasons.add(sa["reason"])
            assert {CACHE, SESSION} <= reasons

            # the predictions are the engines' truth, not just equal to each other
            for body in probes[:12]:
                scored = await score(http, a.url, body)
                for e in engines:
                    _, probe, _ = await post_json(http, e.url + "/sim/probe", body)
                    assert predictions(scored)[e.name] in (probe["cached_tokens"], None), (
                        e.name,
                        scored,
                        probe,
                    )

            # session affinity holds across replicas for real requests too
            for i in range(4):
                user = f"user-{i}"
                fresh = documents(seed=1000 + i, n=2)
                ra = await stream(http, a.url, completion_body(fresh[0], 2, user=user))
                # bounded load counts B's view of A's request until the engines' /metrics
                # (read every 0.5 s) show it finished
                await asyncio.sleep(1.2)
                rb = await stream(http, b.url, completion_body(fresh[1], 2, user=user))
                assert ra.intact(None) and rb.intact(None)
                assert ra.worker == rb.worker

    with Loopback() as lb:
        asyncio.run(main(lb))


@pytest.mark.timeout(60)
def test_replicas_see_each_others_load_through_engine_metrics() -> None:
    async def main(lb: Loopback) -> None:
        engines = lb.engines(2, "--speed", "5")
        config = lb.router_config(engines, load={"metrics_interval_s": 0.2})
        a, b = lb.router(config, "router-a"), lb.router(config, "router-b")
        async with session() as http:
            # long streams through replica A, all on one worker (they share a long prefix)
            doc = documents(3, 1, 300)[0]
            first = await stream(http, a.url, completion_body(doc, 1))
            target = first.worker
            streams = [
                asyncio.create_task(
                    stream(http, a.url, completion_body(f"{doc} {i}", 400, ignore_eos=True))
                )
                for i in range(6)
            ]
            last: list[Any] = []

            async def b_sees_load() -> bool:
                seen = await score(http, b.url, completion_body("hello there"))
                by = {w["worker"]: w for w in seen["workers"]}
                last[:] = [by]
                return by[target]["running"] >= 6 and by[target]["running"] > sum(
                    w["running"] for n, w in by.items() if n != target
                )

            try:
                await eventually(b_sees_load, timeout=15)
            except AssertionError:
                raise AssertionError(f"B sees {last}") from None
            # and B sends new cold work elsewhere
            cold = await score(http, b.url, completion_body("unrelated words here"))
            assert cold["chosen"] != target
            for t in streams:
                t.cancel()
            await asyncio.gather(*streams, return_exceptions=True)

    with Loopback() as lb:
        asyncio.run(main(lb))


def test_cache_choice_does_not_depend_on_registry_order() -> None:
    """Workers listed in another order (discovery order differs per replica) and exact ties
    between them: the same choice, for cache and session decisions."""
    cfg = PolicyConfig()
    choices = set()
    for order in ([0, 1, 2], [2, 1, 0], [1, 2, 0]):
        reg = WorkerRegistry(BreakerConfig())
        ws = [reg.add(WorkerSpec(name=f"w{i}", url=f"http://127.0.0.1:{9000 + i}")) for i in order]
        LoadTicket(next(w for w in ws if w.name == "w2").load, 10)
        policy = make_policy(cfg, LoadModel(cfg, lambda: 1000.0, 5.0))
        cache = policy.decide(ws, RouteInput(4000, {"w0": 3200, "w1": 3200, "w2": 0}, None), 0.0)
        cold = policy.decide(ws, RouteInput(4000, {}, "some-session"), 0.0)
        assert cache.chosen is not None and cold.chosen is not None
        choices.add((cache.chosen.name, cold.chosen.name))
    assert len(choices) == 1


@pytest.mark.timeout(120)
def test_replica_warmup_bench_smoke(tmp_path: Path) -> None:
    import json
    import subprocess

    out = tmp_path / "replicas.json"
    subprocess.run(
        [sys.executable, "-m", "bench.replica_warmup_bench", "--smoke", "--out", str(out)],
        cwd=ROOT,
        check=True,
        timeout=110,
    )
    result = json.loads(out.read_text())
    assert result["runs"] and all(r["agreed"] for r in result["runs"])
    assert all(r["warm_s"] >= r["snapshots_s"] > 0 for r in result["runs"])
