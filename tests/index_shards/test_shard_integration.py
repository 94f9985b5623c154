"""End to end on loopback with index shard processes: simulated engines -> real bridges ->
K=2 shard processes (real processes) -> a real router. Routed like the in-process index; a
killed shard costs evidence, never a request, and comes back from the bridges' snapshots."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvroute.router.index_shards import wire
from kvroute.router.index_shards.client import ShardedIndexView
from tests.router.sim_fleet import MODEL, SimRig, sim_fleet
from tests.router.test_events import until
from tests.router.test_sim_integration import multi_turn

SHARDS = {"index": {"processes": 2, "deadline_s": 5.0, "status_interval_s": 0.05}}


def routed(r: SimRig) -> list[tuple[str, int | None, int | None, str]]:
    """Each request in order: worker, predicted and reported cached tokens, outcome."""
    out = []
    for d in reversed(r.parts.decisions.recent(200)):
        assert d.decision.chosen is not None
        out.append(
            (
                d.decision.chosen.name,
                d.decision.predicted_reuse,
                d.reported_cached_tokens,
                d.outcome,
            )
        )
    return out


def test_two_shards_route_every_request_as_the_in_process_index() -> None:
    async def run(router: dict[str, Any]) -> list[tuple[str, int | None, int | None, str]]:
        async with sim_fleet(4, router=router) as r:
            if router:
                assert isinstance(r.parts.index, ShardedIndexView)
                assert r.parts.shards.supervisor is not None
            await multi_turn(r, sessions=4, turns=3, concurrent=False)
            return routed(r)

    in_process = asyncio.run(run({}))
    sharded = asyncio.run(run(SHARDS))
    assert len(in_process) == 12
    assert sum(1 for _, _, cached, _ in in_process if cached) >= 8  # follow-ups hit
    assert sharded == in_process
    assert {outcome for *_, outcome in sharded} == {"exact"}


def test_a_killed_shard_costs_evidence_not_requests_and_catches_up() -> None:
    async def go() -> None:
        async with sim_fleet(2, router=SHARDS) as r:
            view = r.parts.index
            assert isinstance(view, ShardedIndexView)
            sup = r.parts.shards.supervisor
            messages = [
                {"role": "system", "content": "Shard restart conversation. " * 40},
                {"role": "user", "content": "Tell me everything. " * 20},
            ]
            first = await r.chat(messages)
            home = first["_worker"]
            shard = view.owner(home)
            pid = sup.pid(shard)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            # the admin API stops saying "live" for the dead shard's workers
            await until(lambda: r.parts.events.status(home).state != "live", timeout=5)
            assert "unreachable" in r.parts.events.status(home).last_error
            # while the shard is down (or restarting): every request is still answered
            for i in range(4):
                other = [{"role": "user", "content": f"Another conversation {i}. " * 30}]
                body = {"model": MODEL, "messages": other, "max_tokens": 4}
                resp = await r.client.post("/v1/chat/completions", json=body)
                assert resp.status_code == 200 and resp.json()["choices"]
            await until(lambda: sup.pid(shard) not in (None, pid), timeout=20)
            await until(lambda: not r.parts.events.unusable(), timeout=30)
            await until(lambda: r.parts.shards.events.ready(), timeout=10)
            async with httpx.AsyncClient() as c:
                ready = await c.get(r.url + "/readyz")
                metrics = (await c.get(r.url + "/metrics")).text
            assert ready.status_code == 200 and ready.json()["index"] == "up"
            assert f'kvroute_index_shard_restarts_total{{shard="{shard}"}} 1.0' in metrics
            assert r.parts.events.status(home).snapshots >= 1  # caught up from a snapshot
            # the restarted shard knows the history again: the next turn goes home, exactly
            again = await r.chat([*messages, {"role": "user", "content": "And more?"}])
            d = r.parts.decisions.recent(1)[0]
            assert again["_worker"] == home
            assert d.outcome == "exact" and (d.reported_cached_tokens or 0) > 100

    asyncio.run(go())


def test_readyz_reports_the_index_down_without_its_shards() -> None:
    async def go() -> None:
        async with sim_fleet(1, router=SHARDS) as r, httpx.AsyncClient() as c:
            assert (await c.get(r.url + "/readyz")).json()["index"] == "up"
            r.parts.shards.supervisor.stop()  # every shard gone, none restarted
            await until(lambda: not r.parts.shards.events.ready(), timeout=10)
            resp = await c.get(r.url + "/readyz")
            assert resp.status_code == 503 and resp.json()["index"] == "down"
            # requests are still served, without evidence
            body = {"model": MODEL, "prompt": "hello there", "max_tokens": 2}
            assert (await r.client.post("/v1/completions", json=body)).status_code == 200

    asyncio.run(go())


def shard_status(path: str) -> dict[str, wire.WorkerStatus]:
    """What the shard itself says it follows (a control connection of its own)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        sock.sendall(wire.frame(wire.StatusAsk(1)))
        reader = wire.FrameReader()
        while not (bodies := reader.feed(sock.recv(65536))):
            pass
    answer = wire.decode_from_shard(bodies[0])
    assert isinstance(answer, wire.StatusAnswer)
    return {w.name: w for w in answer.workers}


def test_workers_removed_and_added_through_the_admin_api_are_followed() -> None:
    async def go() -> None:
        async with sim_fleet(2, router=SHARDS) as r:
            view = r.parts.index
            assert isinstance(view, ShardedIndexView)
            sup = r.parts.shards.supervisor
            messages = [
                {"role": "system", "content": "Admin follow conversation. " * 40},
                {"role": "user", "content": "Tell me. " * 20},
            ]
            home = (await r.chat(messages))["_worker"]
            path = sup.socket(view.owner(home))
            assert shard_status(path)[home].state == "live"
            spec = {"name": home, "url": r.engines[home].url}
            spec["bridge"] = f"127.0.0.1:{r.bridges[home].grpc_port}"

            gone = await r.client.delete(f"/admin/workers/{home}?drain=false", headers=r.admin())
            assert gone.status_code == 200
            await until(lambda: home not in shard_status(path), timeout=10)
            assert r.parts.events.status(home) is None

            added = await r.client.post("/admin/workers", json=spec, headers=r.admin())
            assert added.status_code == 201
            await until(lambda: home in shard_status(path), timeout=10)
            await until(lambda: not r.parts.events.unusable(), timeout=30)
            status = r.parts.events.status(home)
            assert status is not None and status.state == "live" and status.snapshots == 1
            # followed afresh from the bridge's snapshot: the history is found again
            again = await r.chat([*messages, {"role": "user", "content": "More."}])
            d = r.parts.decisions.recent(1)[0]
            assert again["_worker"] == home
            assert d.outcome == "exact" and (d.reported_cached_tokens or 0) > 100

            resync = await r.client.post(f"/admin/workers/{home}/resync", headers=r.admin())
            assert resync.status_code == 200
            await until(lambda: shard_status(path)[home].snapshots == 2, timeout=20)

    asyncio.run(go())


def event_metrics(text: str) -> tuple[float, float]:
    """The router's kvroute_event_lag_seconds count and its kvroute_event_batches total."""
    lag = batches = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kvroute_event_lag_seconds_count":
                lag += s.value
            elif s.name == "kvroute_event_batches_total":
                batches += s.value
    return lag, batches


def test_the_shards_event_lag_is_on_the_routers_metrics() -> None:
    async def go() -> None:
        async with sim_fleet(2, router=SHARDS) as r, httpx.AsyncClient() as c:

            async def scraped() -> tuple[float, float]:
                return event_metrics((await c.get(r.url + "/metrics")).text)

            async def lag_beyond(than: float) -> float:
                """The lag count once above `than` (the shards report at each status poll)."""
                for _ in range(200):
                    if (n := (await scraped())[0]) > than:
                        return n
                    await asyncio.sleep(0.05)
                return n

            await r.chat([{"role": "user", "content": "First conversation. " * 30}])
            first = await lag_beyond(0)
            assert first > 0
            for i in range(3):
                await r.chat([{"role": "user", "content": f"Conversation {i}. " * 30}])
            assert await lag_beyond(first) > first
            lag, batches = await scraped()
            assert batches >= lag  # one lag observation per batch applied (with a timestamp)

    asyncio.run(go())
