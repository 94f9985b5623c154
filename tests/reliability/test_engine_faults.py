"""Engine faults, with real processes: what clients receive, what the index holds afterwards,
and what the router's metrics say.

An engine killed mid-stream, an engine restarted (sequence back to 0, cache empty), every
worker unhealthy, a worker flapping, a client that disconnects mid-stream.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from bench.traffic import (
    StreamResult,
    Tally,
    completion_body,
    eventually,
    expected_text,
    metric,
    metrics,
    post_json,
    predictions,
    score,
    session,
    stream,
)
from tests.reliability.conftest import Fleet, cache_on, heal, never_over
from tests.reliability.workload import documents, shared_prefix_prompts


async def _route_to(http: object, f: Fleet, doc: str) -> str:
    """Send `doc` through the router; the worker that now caches it."""
    r = await stream(http, f.router.url, completion_body(doc, 1))  # type: ignore[arg-type]
    assert r.intact(None), r
    assert r.worker is not None
    return r.worker


@pytest.mark.timeout(60)
def test_engine_killed_mid_stream(fleet: Fleet) -> None:
    async def main() -> None:
        async with session() as http:
            await heal(http, fleet)
            doc = documents(11, 1, 300)[0]
            victim = await _route_to(http, fleet, doc)
            engine = fleet.engine(victim)
            await post_json(http, engine.url + "/sim/faults", {"slowdown": 300.0})
            before = await metrics(http, fleet.router.url)
            long = [completion_body(f"{doc} {i}", 3000, ignore_eos=True) for i in range(4)]
            tasks = [asyncio.create_task(stream(http, fleet.router.url, b)) for b in long]

            async def streaming() -> bool:
                _, state, _ = await post_json(http, engine.url + "/sim/state", method="GET")
                return bool(state["running"] >= 4)

            await eventually(streaming, timeout=10)
            await asyncio.sleep(0.3)
            engine.proc.kill()
            results: list[StreamResult] = await asyncio.wait_for(asyncio.gather(*tasks), 15)
            for r in results:
                # a started stream cannot move: it ends with an error event and [DONE]
                assert r.status == 200 and r.worker == victim
                assert r.done and r.error is not None and "mid-stream" in r.error, r
                assert r.events >= 1 and r.finish_reason is None

            # new requests for the same prefix are served elsewhere, intact
            other = next(e for e in fleet.engines if e.name != victim)
            expected = await expected_text(http, other.url, completion_body(doc + " again", 8))
            again = await asyncio.gather(
                *(
                    stream(http, fleet.router.url, completion_body(doc + " again", 8))
                    for _ in range(6)
                )
            )
            assert all(r.intact(expected) and r.worker != victim for r in again), again

            after = await metrics(http, fleet.router.url)
            assert (
                metric(after, "kvroute_errors_total", kind="mid_stream")
                - metric(before, "kvroute_errors_total", kind="mid_stream")
                == 4
            )

            async def marked_down() -> bool:
                page = await metrics(http, fleet.router.url)
                return metric(page, "kvroute_worker_healthy", worker=victim) == 0

            await eventually(marked_down, timeout=5)
            # the dead engine's cache is gone from the index (its bridge emptied the view)
            scored = predictions(await score(http, fleet.router.url, completion_body(doc)))
            assert scored[victim] in (0, None)
            await heal(http, fleet)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_engine_restarted_gives_no_stale_hits(fleet: Fleet) -> None:
    async def main() -> None:
        async with session() as http:
            await heal(http, fleet)
            engine = fleet.engines[0]
            prompts = shared_prefix_prompts(21, docs=3, per_doc=2)
            bodies = await cache_on(http, engine, prompts)

            async def predicted_on_engine() -> bool:
                p = predictions(await score(http, fleet.router.url, bodies[0]))
                return (p[engine.name] or 0) > 0

            await eventually(predicted_on_engine, timeout=10)
            before = await metrics(http, fleet.router.url)
            fleet.lb.restart_engine(engine)  # SIGKILL, then a fresh process on the same ports

            async def forgotten() -> bool:
                for body in bodies:
                    if (
                        predictions(await score(http, fleet.router.url, body))[engine.name] or 0
                    ) > 0:
                        return False
                return True

            await eventually(forgotten, timeout=10)
            await never_over(http, fleet, bodies)
            await heal(http, fleet)
            # no answer is predicted above what the engine reports (verified per request): no
            # stale hit survives the restart, and a sibling sent right behind a prompt to the
            # restarted engine (layout not yet known from its events) is not routed there as a
            # junction investment (indexer: no coverage for a layout it does not know). Under
            # is allowed: the sibling can arrive before the events of the prompt ahead of it
            # (event lag; as an exact check it failed 4 of 6 runs of this file)
            for body in bodies:
                usage = {"stream_options": {"include_usage": True}}
                r = await stream(http, fleet.router.url, {**body, **usage})
                assert r.intact(None) and r.predicted <= r.cached_tokens, r
            after = await metrics(http, fleet.router.url)
            over = "kvroute_prediction_outcomes_total"
            assert metric(after, over, outcome="over") == metric(before, over, outcome="over")
            snaps = "kvroute_event_snapshots_total"
            assert metric(after, snaps, worker=engine.name) > metric(
                before, snaps, worker=engine.name
            )
            bridge_page = await metrics(http, fleet.bridge(engine.name).http_url)
            assert metric(bridge_page, "kvroute_bridge_resets_total", reason="disconnect") >= 1

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_all_workers_unhealthy_is_503_with_retry_after(fleet: Fleet) -> None:
    async def main() -> None:
        async with session() as http:
            await heal(http, fleet)
            for e in fleet.engines:  # hung engines: /health times out
                await post_json(http, e.url + "/sim/faults", {"hang": True})

            async def router_down() -> bool:
                status, _, _ = await post_json(http, fleet.router.url + "/health", method="GET")
                return status == 503

            await eventually(router_down, timeout=10)
            before = await metrics(http, fleet.router.url)
            started = time.monotonic()
            r = await stream(http, fleet.router.url, completion_body("hello", 4))
            assert time.monotonic() - started < 2  # answered at once, not queued on a hung engine
            assert r.status == 503 and r.retry_after is not None and int(r.retry_after) >= 1
            assert b'"error"' in r.body and b"no healthy worker" in r.body
            status, body, headers = await post_json(
                http,
                fleet.router.url + "/v1/chat/completions",
                {"model": "kvroute-sim", "messages": [{"role": "user", "content": "hi"}]},
            )
            assert status == 503 and "retry-after" in headers and body["error"]["code"] == 503
            after = await metrics(http, fleet.router.url)
            assert (
                metric(after, "kvroute_errors_total", kind="no_worker")
                - metric(before, "kvroute_errors_total", kind="no_worker")
                == 2
            )
            assert all(
                metric(after, "kvroute_worker_healthy", worker=e.name) == 0 for e in fleet.engines
            )
            await heal(http, fleet)
            r = await stream(http, fleet.router.url, completion_body("hello", 4))
            assert r.intact(None)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_flapping_worker_loses_no_request(fleet: Fleet) -> None:
    async def main() -> None:
        async with session() as http:
            await heal(http, fleet)
            flappy = fleet.engines[1]
            before = await metrics(http, fleet.router.url)
            prompts = [f"question {i} about flapping" for i in range(12)]
            expected = {
                p: await expected_text(http, fleet.engines[0].url, completion_body(p, 8))
                for p in prompts
            }
            stop = asyncio.Event()

            async def flap() -> None:
                up = False
                while not stop.is_set():
                    rate = 0.0 if up else 1.0
                    await post_json(http, flappy.url + "/sim/faults", {"fail_rate": rate})
                    up = not up
                    await asyncio.sleep(0.3)

            tally = Tally()

            async def client(k: int) -> None:
                i = k
                while not stop.is_set():
                    p = prompts[i % len(prompts)]
                    tally.add(
                        await stream(http, fleet.router.url, completion_body(p, 8)), expected[p]
                    )
                    i += 4

            flapper = asyncio.create_task(flap())
            clients = [asyncio.create_task(client(k)) for k in range(4)]
            await asyncio.sleep(4)
            stop.set()
            await asyncio.gather(flapper, *clients)
            assert tally.sent >= 40 and tally.lost == 0 and tally.refused == 0, tally
            after = await metrics(http, fleet.router.url)
            d = lambda name, **kw: metric(after, name, **kw) - metric(before, name, **kw)  # noqa: E731
            assert d("kvroute_retries_total", cause="5xx") >= 1
            assert d("kvroute_breaker_transitions_total", worker=flappy.name, to="open") >= 1
            assert d("kvroute_upstream_responses_total", worker=flappy.name, outcome="5xx") >= 1
            await heal(http, fleet)

            async def serves_again() -> bool:
                r = await stream(http, fleet.router.url, completion_body("x", 2, user="flap"))
                page = await metrics(http, fleet.router.url)
                return (
                    r.intact(None)
                    and metric(page, "kvroute_worker_breaker_state", worker=flappy.name) == 0
                )

            await eventually(serves_again, timeout=10)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_client_disconnect_cancels_the_upstream_request(fleet: Fleet) -> None:
    async def main() -> None:
        async with session() as http:
            await heal(http, fleet)
            before = await metrics(http, fleet.router.url)
            body = completion_body("a long story please", 5000, ignore_eos=True)
            for e in fleet.engines:
                await post_json(http, e.url + "/sim/faults", {"slowdown": 100.0})
            r = await stream(http, fleet.router.url, body, stop_after_events=3)
            assert r.status == 200 and r.events == 3 and not r.done
            target = fleet.engine(r.worker or "")

            async def cancelled() -> bool:
                _, state, _ = await post_json(http, target.url + "/sim/state", method="GET")
                page = await metrics(http, fleet.router.url)
                return (
                    state["running"] == 0
                    and state["waiting"] == 0
                    and metric(page, "kvroute_worker_running", worker=target.name) == 0
                )

            # the stream would run for minutes; the engine stops it within moments
            await eventually(cancelled, timeout=5)
            after = await metrics(http, fleet.router.url)
            assert (
                metric(after, "kvroute_client_disconnects_total")
                - metric(before, "kvroute_client_disconnects_total")
                == 1
            )
            await heal(http, fleet)

    asyncio.run(main())
