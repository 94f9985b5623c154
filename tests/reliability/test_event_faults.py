"""Faults on the event path, with real processes: a bridge killed and restarted, a router
restarted, an event gap beyond the engine's replay buffer, a slow subscriber, the router cut off
from a bridge (refused and silently dropped), malformed frames and payloads from an engine, and
garbage protobuf from a bridge. Each asserts what clients receive, what the index holds
afterwards (against the engines' own answers, /sim/probe) and what the metrics say."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest

from bench.netcut import CutRelay
from bench.traffic import (
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
    workers,
)
from kvroute.bridge.server import SERVICE
from kvroute.proto import events_pb2
from tests.reliability.conftest import Fleet, cache_on, exact, heal, never_over
from tests.reliability.workload import documents, shared_prefix_prompts


async def _live(http: Any, router: str, name: str) -> bool:
    return bool((await workers(http, router))[name]["events"]["state"] == "live")


@pytest.mark.timeout(60)
def test_bridge_killed_and_restarted(fleet: Fleet) -> None:
    async def main() -> None:
        async with session() as http:
            await heal(http, fleet)
            e = fleet.engines[0]
            bodies = await cache_on(http, e, shared_prefix_prompts(31, 2, 2))
            await eventually(lambda: exact(http, fleet, bodies), timeout=10)
            before = await metrics(http, fleet.router.url)
            fleet.bridge(e.name).proc.kill()

            async def unused() -> bool:
                p = predictions(await score(http, fleet.router.url, bodies[0]))
                return p[e.name] is None and not await _live(http, fleet.router.url, e.name)

            await eventually(unused, timeout=10)
            # clients are still served by every worker, the blind one included
            expected = await expected_text(http, e.url, completion_body("still here?", 8))
            results = await asyncio.gather(
                *(
                    stream(http, fleet.router.url, completion_body("still here?", 8))
                    for _ in range(6)
                )
            )
            assert all(r.intact(expected) for r in results)
            # the engine keeps working while its bridge is down; the new bridge learns this
            # from the engine's replay buffer when it joins
            more = await cache_on(http, e, shared_prefix_prompts(32, 2, 1))
            fleet.lb.restart_bridge(fleet.bridge(e.name))
            await eventually(lambda: exact(http, fleet, bodies + more), timeout=15)
            after = await metrics(http, fleet.router.url)
            d = lambda name, **kw: metric(after, name, **kw) - metric(before, name, **kw)  # noqa: E731
            assert d("kvroute_event_stream_lost_total", worker=e.name) == 1
            assert d("kvroute_event_snapshots_total", worker=e.name) >= 1

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_router_restarted(fleet: Fleet) -> None:
    async def main() -> None:
        async with session() as http:
            await heal(http, fleet)
            bodies = []
            for i, e in enumerate(fleet.engines):
                bodies += await cache_on(http, e, shared_prefix_prompts(40 + i, 2, 2))
            await eventually(lambda: exact(http, fleet, bodies), timeout=10)
            fleet.lb.restart_router(fleet.router)  # SIGKILL, then a new process, same port
            await eventually(lambda: exact(http, fleet, bodies), timeout=10)
            page = await metrics(http, fleet.router.url)
            for e in fleet.engines:  # each worker's view came from an initial snapshot
                assert (
                    metric(page, "kvroute_event_snapshots_total", worker=e.name, reason="initial")
                    == 1
                )
            expected = await expected_text(http, fleet.engines[0].url, bodies[0])
            r = await stream(http, fleet.router.url, bodies[0])
            assert r.intact(expected) and (r.predicted or 0) > 0

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_gap_beyond_the_replay_buffer(fleet: Fleet) -> None:
    async def main() -> None:
        async with session() as http:
            await heal(http, fleet)
            e = fleet.engines[1]
            old = await cache_on(http, e, shared_prefix_prompts(50, 2, 2))
            await eventually(lambda: exact(http, fleet, old), timeout=10)
            before = await metrics(http, fleet.router.url)
            bridge_before = await metrics(http, fleet.bridge(e.name).http_url)
            await post_json(
                http, e.url + "/sim/faults", {"drop_batches": 2, "drop_from_replay": True}
            )
            lost = []
            for p in shared_prefix_prompts(51, 4, 1):  # one batch each: two never arrive
                lost += await cache_on(http, e, [p])

            async def reset_seen() -> bool:
                page = await metrics(http, fleet.router.url)
                return metric(
                    page, "kvroute_event_snapshots_total", worker=e.name, reason="gap"
                ) > metric(before, "kvroute_event_snapshots_total", worker=e.name, reason="gap")

            await eventually(reset_seen, timeout=10)
            # what the index holds now may be less than the engine has, never more
            await never_over(http, fleet, old + lost)
            fresh = await cache_on(http, e, shared_prefix_prompts(52, 2, 1))
            await eventually(lambda: exact(http, fleet, fresh), timeout=10)
            page = await metrics(http, fleet.bridge(e.name).http_url)
            assert metric(page, "kvroute_bridge_resets_total", reason="gap") > metric(
                bridge_before, "kvroute_bridge_resets_total", reason="gap"
            )
            assert metric(page, "kvroute_bridge_replays_total", outcome="unrecoverable") >= 1
            r = await stream(http, fleet.router.url, {**fresh[0], "max_tokens": 4})
            assert r.intact(None)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_malformed_frames_and_payloads_from_an_engine(fleet: Fleet) -> None:
    async def main() -> None:
        async with session() as http:
            await heal(http, fleet)
            e = fleet.engines[0]
            bridge = fleet.bridge(e.name)
            for kind, seed in (("frames", 60), ("payload", 61)):
                bodies = await cache_on(http, e, shared_prefix_prompts(seed, 2, 1))
                await eventually(lambda b=bodies: exact(http, fleet, b), timeout=10)
                before = await metrics(http, bridge.http_url)
                await post_json(http, e.url + "/sim/faults", {"malformed": kind})
                after_bodies = await cache_on(http, e, shared_prefix_prompts(seed + 100, 1, 1))

                async def counted(before: dict[str, float] = before) -> bool:
                    page = await metrics(http, bridge.http_url)
                    return metric(page, "kvroute_bridge_resets_total", reason="malformed") > metric(
                        before, "kvroute_bridge_resets_total", reason="malformed"
                    )

                await eventually(counted, timeout=10)
                page = await metrics(http, bridge.http_url)
                assert metric(page, "kvroute_bridge_malformed_frames_total") > metric(
                    before, "kvroute_bridge_malformed_frames_total"
                )
                await never_over(http, fleet, bodies + after_bodies)
                fresh = await cache_on(http, e, shared_prefix_prompts(seed + 200, 1, 1))
                await eventually(lambda b=fresh: exact(http, fleet, b), timeout=10)
                assert await _live(http, fleet.router.url, e.name)

    asyncio.run(main())


@pytest.mark.timeout(90)
def test_router_cut_off_from_a_bridge(fleet: Fleet) -> None:
    async def main() -> None:
        async with session() as http:
            await heal(http, fleet)
            e, other = fleet.engines
            relay = CutRelay(fleet.bridge(e.name).addr)
            await relay.start()
            config = fleet.lb.router_config(
                fleet.engines,
                fleet.bridges,
                events={"keepalive_s": 0.3, "keepalive_timeout_s": 1.0,
                        "reconnect_initial_s": 0.05, "reconnect_max_s": 0.3},
            )  # fmt: skip
            config["workers"][0]["bridge"] = relay.addr
            router = fleet.lb.router(config, "router-cut")
            try:
                # quiet streams are kept alive (pings every 0.3 s are accepted by the bridge)
                await asyncio.sleep(2)
                ws = await workers(http, router.url)
                assert ws[e.name]["events"]["reconnects"] == 0, ws[e.name]["events"]
                bodies = await cache_on(http, e, shared_prefix_prompts(370, 2, 1))
                await eventually(lambda: exact(http, fleet, bodies, router.url), timeout=10)
                bridge_before = await metrics(http, fleet.bridge(e.name).http_url)

                for cut, seed in (("blackhole", 371), ("refuse", 372)):
                    before = await metrics(http, router.url)
                    if cut == "blackhole":
                        relay.blackhole()  # silent: only keepalive notices
                    else:
                        await relay.refuse()

                    async def blind() -> bool:
                        p = predictions(await score(http, router.url, bodies[0]))
                        return p[e.name] is None and not await _live(http, router.url, e.name)

                    await eventually(blind, timeout=10)
                    tally = Tally()
                    for _ in range(6):
                        tally.add(await stream(http, router.url, completion_body("cut?", 4)), None)
                    assert tally.intact == 6, tally
                    during = await cache_on(http, e, shared_prefix_prompts(seed, 2, 1))
                    await relay.restore()
                    await eventually(
                        lambda d=during: exact(http, fleet, bodies + d, router.url), timeout=15
                    )
                    after = await metrics(http, router.url)
                    lost = "kvroute_event_stream_lost_total"
                    assert (
                        metric(after, lost, worker=e.name) - metric(before, lost, worker=e.name)
                        == 1
                    )
                    # resumed where it stopped: the missed batches, not a snapshot
                    snaps = "kvroute_event_snapshots_total"
                    assert metric(after, snaps, worker=e.name) == metric(
                        before, snaps, worker=e.name
                    )
                page = await metrics(http, fleet.bridge(e.name).http_url)
                assert (
                    metric(page, "kvroute_bridge_resumes_total")
                    - metric(bridge_before, "kvroute_bridge_resumes_total")
                    >= 2
                )
                assert await _live(http, router.url, other.name)
            finally:
                router.proc.stop()
                await relay.close()

    asyncio.run(main())


class _FakeBridge:
    """A gRPC server speaking KvEvents that sends whatever it is told (bytes on the wire)."""

    def __init__(self, messages: list[bytes]) -> None:
        self.messages = messages
        self.subscriptions = 0
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self) -> str:
        async def subscribe(request: bytes, context: Any) -> AsyncIterator[bytes]:
            self.subscriptions += 1
            for m in self.messages:
                yield m
            await asyncio.sleep(3600)

        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Subscribe": grpc.unary_stream_rpc_method_handler(
                    subscribe,
                    request_deserializer=lambda b: b,
                    response_serializer=lambda b: b,
                )
            },
        )
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)


def nonsense_messages(rng: random.Random, n: int) -> list[bytes]:
    """Valid protobuf, meaningless content: odd block sizes and kinds, parents that do not
    exist, removes of unknown blocks, clears, sequences out of order, huge numbers."""
    out = []
    for i in range(n):
        events = []
        for _ in range(rng.randint(0, 6)):
            ev = events_pb2.KvGroupEvent(
                operation=rng.choice([0, 1, 2, 3, 7]),
                group_id=rng.choice([0, 1, 5, 2**31 - 1]),
                block_hashes=[
                    rng.randbytes(rng.choice([0, 3, 8, 32])) for _ in range(rng.choice([0, 1, 3]))
                ],
                parent_block_hash=rng.randbytes(rng.choice([0, 8])),
                token_ids=[rng.randint(0, 2**32 - 1) for _ in range(rng.choice([0, 1, 16, 17]))],
                block_size=rng.choice([0, 1, 16, 7, 2**31 - 1]),
                kind=rng.choice(["full_attention", "sliding_window", "mamba", "", "??"]),
                sliding_window=rng.choice([0, 1, 512, 2**31 - 1]),
                lora_name=rng.choice(["", "x"]),
                cache_namespace=rng.choice(["", "s"]),
                unmatchable=rng.random() < 0.2,
            )
            events.append(ev)
        if rng.random() < 0.3:
            msg = events_pb2.SubscribeResponse(
                snapshot=events_pb2.Snapshot(
                    sequence=rng.randint(0, 2**63 - 1),
                    has_sequence=rng.random() < 0.5,
                    events=events,
                    stream_id=rng.choice(["", "s/0/0", "\u00e9"]),
                    reason=rng.choice(["", "initial", "weird"]),
                )
            )
        else:
            msg = events_pb2.SubscribeResponse(
                batch=events_pb2.KvEventBatch(
                    sequence=rng.choice([i, 0, 2**63 - 1, rng.randint(0, 50)]), events=events
                )
            )
        out.append(msg.SerializeToString())
    return out


@pytest.mark.timeout(60)
def test_garbage_and_nonsense_protobuf_from_a_bridge(fleet: Fleet) -> None:
    async def main() -> None:
        rng = random.Random(3)
        garbage = [rng.randbytes(rng.randint(1, 300)) for _ in range(5)]
        async with session() as http:
            await heal(http, fleet)
            for name, messages in (
                ("garbage", garbage),
                ("nonsense", nonsense_messages(rng, 300)),
            ):
                fake = _FakeBridge(messages)
                addr = await fake.start()
                config = fleet.lb.router_config(fleet.engines, fleet.bridges)
                config["workers"][0]["bridge"] = addr
                router = fleet.lb.router(config, f"router-{name}")
                try:
                    need = 2 if name == "garbage" else 1  # garbage: dropped and retried
                    await eventually(lambda f=fake, n=need: _subscribed(f, n), timeout=10)
                    await asyncio.sleep(1.0)  # everything sent has been taken in
                    # the router is still whole: it scores, answers and follows the good bridge
                    expected = await expected_text(
                        http, fleet.engines[1].url, completion_body("ok?", 4)
                    )
                    for _ in range(4):
                        r = await stream(http, router.url, completion_body("ok?", 4))
                        assert r.intact(expected), r
                    scored = await score(http, router.url, completion_body(documents(1, 1)[0]))
                    assert scored["chosen"] is not None
                    assert await _live(http, router.url, fleet.engines[1].name)
                    ws = await workers(http, router.url)
                    if name == "garbage":  # undecodable: the stream is dropped and retried
                        assert ws[fleet.engines[0].name]["events"]["state"] != "live"
                        assert ws[fleet.engines[0].name]["events"]["reconnects"] >= 1
                        page = await metrics(http, router.url)
                        bad = "kvroute_event_bad_messages_total"
                        assert metric(page, bad, worker=fleet.engines[0].name) >= 1
                    assert router.proc.alive()
                finally:
                    router.proc.stop()
                    await fake.stop()

    asyncio.run(main())


async def _subscribed(fake: _FakeBridge, n: int) -> bool:
    return fake.subscriptions >= n


@pytest.mark.timeout(90)
def test_slow_subscriber_gets_a_snapshot_and_others_are_unaffected(fleet: Fleet) -> None:
    async def main() -> None:
        async with session(limit=32) as http:
            await heal(http, fleet)
            e = fleet.engines[1]
            bridge = fleet.bridge(e.name)
            bridge.args = ("--queue-size", "16")
            fleet.lb.restart_bridge(bridge, kill=False)
            await heal(http, fleet)
            # a subscriber that stops reading, with a small fixed HTTP/2 window so the bridge
            # notices soon (the router beside it keeps reading)
            channel = grpc.aio.insecure_channel(bridge.addr, options=[("grpc.http2.bdp_probe", 0)])
            slow = channel.unary_stream(
                "/kvroute.v1.KvEvents/Subscribe",
                request_serializer=events_pb2.SubscribeRequest.SerializeToString,
                response_deserializer=events_pb2.SubscribeResponse.FromString,
            )(events_pb2.SubscribeRequest())
            try:
                await slow.initial_metadata()
                before = await metrics(http, fleet.router.url)
                docs = shared_prefix_prompts(480, 200, 1, words=400)
                sent: list[dict[str, Any]] = []
                for i in range(0, len(docs), 4):
                    sent += await cache_on(http, e, docs[i : i + 4])
                    # the reading router drains each small step before the next, so only a
                    # subscriber that stops reading can fall --queue-size messages behind
                    newest = sent[-1:]
                    await eventually(lambda b=newest: exact(http, fleet, b), timeout=10)
                    page = await metrics(http, bridge.http_url)
                    if metric(page, "kvroute_bridge_lagging_subscribers_total") >= 1:
                        break
                page = await metrics(http, bridge.http_url)
                assert metric(page, "kvroute_bridge_lagging_subscribers_total") >= 1
                # the reading subscriber was never held back nor resynchronised
                await eventually(lambda: exact(http, fleet, sent[-4:] + sent[:2]), timeout=10)
                after = await metrics(http, fleet.router.url)
                snaps = "kvroute_event_snapshots_total"
                assert metric(after, snaps, worker=e.name) == metric(before, snaps, worker=e.name)
                # the slow one, once it reads, gets a snapshot and then the live stream
                _, health, _ = await post_json(http, bridge.http_url + "/health", method="GET")
                last = health["ranks"]["0"]["last_sequence"]
                reasons = []
                async for message in slow:
                    if message.HasField("snapshot"):
                        reasons.append(message.snapshot.reason)
                        seq = message.snapshot.sequence
                    else:
                        seq = message.batch.sequence
                    if seq == last:
                        break
                assert "lagging" in reasons
            finally:
                slow.cancel()
                await channel.close()
                bridge.args = ()
                fleet.lb.restart_bridge(bridge, kill=False)
                await heal(http, fleet)
            # a router that stops reading for a while (SIGSTOP) is whole again afterwards
            fleet.router.proc.pause()
            more = await cache_on(http, e, shared_prefix_prompts(481, 20, 1, words=400))
            await asyncio.sleep(0.5)
            fleet.router.proc.resume()
            await eventually(lambda: exact(http, fleet, more[-3:]), timeout=15)

    asyncio.run(main())
