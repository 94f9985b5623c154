"""The bridge end to end on loopback: fake engine (ZMQ PUB + ROUTER) -> bridge -> gRPC."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio
from bridge_testkit import CLEAR, STORE, FakeEngine, Recorder, View, be, eventually, store

from kvroute.bridge import follower as follower_module
from kvroute.bridge import vllm_schema as s
from kvroute.bridge.app import Bridge, BridgeConfig
from kvroute.bridge.client import ResumePoint
from kvroute.bridge.follower import EngineEndpoints
from kvroute.bridge.stream import StreamLimits
from kvroute.proto.namespace import salt_namespace
from kvroute.router.routing.fleet_index_view import FleetIndexView

TOKENS = list(range(1000, 1064))


class Rig:
    """The fake engines, bridges and subscribers of one test, closed newest first when the
    test ends, whether it passes or not."""

    def __init__(self, ctx: zmq.asyncio.Context, stack: contextlib.AsyncExitStack) -> None:
        self.ctx = ctx
        self._stack = stack

    def engine(self, **options: Any) -> FakeEngine:
        engine = FakeEngine(self.ctx, **options)
        self._stack.push_async_callback(engine.close)
        return engine

    async def bridge(self, *engines: EngineEndpoints, **config: Any) -> Bridge:
        config.setdefault("replay_timeout", 1.0)
        config.setdefault("listen", "127.0.0.1:0")
        bridge = Bridge(BridgeConfig(engines=engines, http="127.0.0.1:0", **config))
        await bridge.start()
        self._stack.push_async_callback(bridge.stop)
        return bridge

    def recorder(self, bridge: Bridge, **options: Any) -> Recorder:
        recorder = Recorder(f"127.0.0.1:{bridge.grpc_port}", **options)
        self._stack.push_async_callback(recorder.close)
        return recorder

    async def beside_quiet_engine(self, batches: int) -> tuple[FakeEngine, Bridge, Recorder]:
        """An engine that published `batches` chained batches before the bridge existed and
        then went quiet, a bridge that took them through its joining replay, a subscriber
        that has them all."""
        engine = self.engine()
        for i in range(batches):
            await engine.publish([store([i + 1], i or None, TOKENS[:16])])
        bridge = await self.bridge(engine.endpoints())
        recorder = self.recorder(bridge)
        await recorder.wait_for(lambda: recorder.position.sequence == batches - 1)
        return engine, bridge, recorder

    async def follow(self, **engine_options: Any) -> tuple[FakeEngine, Bridge, Recorder]:
        """One engine, a bridge following it and a subscriber, the bridge connected."""
        engine = self.engine(**engine_options)
        bridge = await self.bridge(engine.endpoints(), follower_recovery_s=1.0)
        recorder = self.recorder(bridge)
        await connected(bridge)
        return engine, bridge, recorder


def run(test: Callable[[Rig], Awaitable[None]]) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            async with contextlib.AsyncExitStack() as stack:
                await test(Rig(ctx, stack))
        finally:
            ctx.destroy(linger=0)

    asyncio.run(asyncio.wait_for(main(), 60))


async def connected(bridge: Bridge) -> None:
    await eventually(lambda: bridge.ready)
    await asyncio.sleep(0.3)  # let the SUB subscription reach the PUB socket


def metric(bridge: Bridge, name: str, **labels: str) -> float:
    value = bridge.metrics.registry.get_sample_value(name, {"dp_rank": "0", **labels})
    return value or 0.0


async def new_engine_batch(bridge: Bridge, seq: int, block: int) -> None:
    """Hand rank 0's follower a live batch, as a restarted engine (its own payload: one
    stored block) would publish it at `seq`."""
    payload = s.encode_batch(2.0, [store([block], None, TOKENS[:16])], 0, "0.33")
    await bridge.followers[0].on_live(s.live_frames("kv", seq, payload))


def test_live_stream_and_late_subscriber() -> None:
    async def main(rig: Rig) -> None:
        engine = rig.engine()
        bridge = await rig.bridge(engine.endpoints())
        early = rig.recorder(bridge)
        await early.wait_for(lambda: len(early.snapshots()) == 1)
        assert early.snapshots()[0].reason == "initial" and not early.snapshots()[0].events
        await connected(bridge)
        await engine.publish([store([1, 2, 3, 4], None, TOKENS)])
        await engine.publish([s.BlockRemoved([4], group_idx=0), store([5], 3, TOKENS[48:])])
        await engine.publish(
            [
                store(
                    [11, 12],
                    None,
                    TOKENS[:32],
                    group_idx=1,
                    kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=32,
                )
            ]
        )
        await early.wait_for(lambda: len(early.batches()) == 3)
        assert [b.sequence for b in early.batches()] == [0, 1, 2]
        first = early.batches()[0].events[0]
        assert first.operation == STORE and list(first.block_hashes) == [
            be(i) for i in (1, 2, 3, 4)
        ]
        assert list(first.token_ids) == TOKENS and first.kind == "full_attention"
        late = rig.recorder(bridge)
        await late.wait_for(lambda: len(late.messages) == 1)
        (snap,) = late.snapshots()
        assert snap.reason == "initial" and snap.has_sequence and snap.sequence == 2
        assert late.view.counts == early.view.counts and len(early.view.counts) == 6
        await engine.publish([s.AllBlocksCleared()])
        await late.wait_for(lambda: len(late.batches()) == 1)
        assert late.batches()[0].events[0].operation == CLEAR and not late.view.counts
        async with httpx.AsyncClient() as http:
            health = (await http.get(f"http://127.0.0.1:{bridge.http_port}/health")).json()
            text = (await http.get(f"http://127.0.0.1:{bridge.http_port}/metrics")).text
            ready = await http.get(f"http://127.0.0.1:{bridge.http_port}/ready")
        assert health["ready"] and health["ranks"]["0"]["last_sequence"] == 3
        assert health["ranks"]["0"]["subscribers"] == 2 and ready.status_code == 200
        assert 'kvroute_bridge_batches_total{dp_rank="0"} 4.0' in text
        assert 'kvroute_bridge_events_total{dp_rank="0",kind="store"} 3.0' in text
        assert "kvroute_bridge_lag_seconds_bucket" in text and "kvroute_bridge_subscribers" in text

    run(main)


@pytest.mark.parametrize("version", ["0.23", "0.33"])  # pre-0.26 and 0.26+ replay layouts
def test_gap_recovered_by_replay(version: str) -> None:
    async def main(rig: Rig) -> None:
        engine, bridge, rec = await rig.follow(version=version)
        await engine.publish([store([1], None, TOKENS[:16])])
        await engine.publish([store([2], 1, TOKENS[16:32])], drop=True)
        await engine.publish([store([3], 2, TOKENS[32:48])], drop=True)
        await engine.publish([store([4], 3, TOKENS[48:64])])
        await rec.wait_for(lambda: len(rec.batches()) == 4)
        assert [b.sequence for b in rec.batches()] == [0, 1, 2, 3]
        assert len(rec.snapshots()) == 1  # only the initial one: no reset
        # the gap asked for a replay from 1; any other request is a join from 0 (the bridge
        # asks a quiet engine for its buffer), which may come before or after it
        assert 1 in engine.replay_requests and set(engine.replay_requests) <= {0, 1}
        assert metric(bridge, "kvroute_bridge_gaps_total") == 1
        assert metric(bridge, "kvroute_bridge_replays_total", outcome="recovered") >= 1
        assert len(rec.view.counts) == 4

    run(main)


def test_unrecoverable_gap_resets_view() -> None:
    async def main(rig: Rig) -> None:
        engine, bridge, rec = await rig.follow(buffer_steps=2)
        await engine.publish([store([1], None, TOKENS[:16])])
        for i in range(4):  # seqs 1-4 lost; the engine keeps only 3 and 4
            await engine.publish([store([10 + i], None, TOKENS[:16])], drop=True)
        await engine.publish([store([20], None, TOKENS[:16])])
        await rec.wait_for(lambda: rec.position.sequence == 5)
        first_id = rec.snapshots()[0].stream_id
        reset = rec.snapshots()[-1]
        assert reset.reason == "gap" and reset.stream_id != first_id and not reset.events
        assert [b.sequence for b in rec.batches()][-2:] == [4, 5]  # 4 and 5 were buffered
        assert set(rec.view.counts) == {(0, be(13)), (0, be(20))}
        # counted when the replay's end arrives, which may be after the subscriber saw seq 5
        await eventually(
            lambda: metric(bridge, "kvroute_bridge_replays_total", outcome="unrecoverable") == 1
        )
        assert metric(bridge, "kvroute_bridge_resets_total", reason="gap") == 1

    run(main)


def test_gap_without_replay_endpoint_resets() -> None:
    async def main(rig: Rig) -> None:
        engine, bridge, rec = await rig.follow(replay=False)
        await engine.publish([store([1], None, TOKENS[:16])])
        await engine.publish([store([2], None, TOKENS[:16])], drop=True)
        await engine.publish([store([3], None, TOKENS[:16])])
        await rec.wait_for(lambda: rec.position.sequence == 2)
        assert rec.snapshots()[-1].reason == "gap" and rec.snapshots()[-1].sequence == 1
        assert set(rec.view.counts) == {(0, be(3))}
        assert metric(bridge, "kvroute_bridge_replays_total", outcome="unavailable") == 1

    run(main)


def test_engine_restart_resets_view() -> None:
    async def main(rig: Rig) -> None:
        engine, bridge, rec = await rig.follow()
        for i in range(3):
            await engine.publish([store([i + 1], None, TOKENS[:16])])
        await rec.wait_for(lambda: rec.position.sequence == 2)
        old_id = rec.position.stream_id
        await engine.close()
        await eventually(lambda: not bridge.ready)
        # the engine (and its cache) is gone: the view is emptied at once, not when it is back
        await rec.wait_for(lambda: not rec.view.counts and rec.position.stream_id != old_id)
        engine = rig.engine(pub_port=engine.pub_port, replay_port=engine.replay_port)
        await connected(bridge)
        await engine.publish([store([100], None, TOKENS[:16])])
        await rec.wait_for(lambda: (0, be(100)) in rec.view.counts)
        assert rec.position.stream_id != old_id
        assert set(rec.view.counts) == {(0, be(100))}
        assert rec.snapshots()[-1].reason in ("disconnect", "reconnect", "restart")

    run(main)


def test_restarted_engine_taken_through_an_idle_join_is_reset_once() -> None:
    # The new engine buffers a batch before the bridge reconnects; the bridge takes it through
    # its replay while the engine is quiet. Its next live batch then continues that view: the
    # disconnect already reset it, a second reset would only make routers resync for nothing.
    async def main(rig: Rig) -> None:
        engine, bridge, rec = await rig.follow()
        await engine.publish([store([1], None, TOKENS[:16])])
        await rec.wait_for(lambda: rec.position.sequence == 0)
        pub_port, replay_port = engine.pub_port, engine.replay_port
        await engine.close()
        await eventually(lambda: not bridge.ready)
        engine = rig.engine(pub_port=pub_port, replay_port=replay_port)
        await engine.publish([store([100], None, TOKENS[:16])])  # before the bridge is back
        await rec.wait_for(lambda: set(rec.view.counts) == {(0, be(100))})
        await connected(bridge)
        await engine.publish([store([101], 100, TOKENS[:16])])
        await rec.wait_for(lambda: rec.position.sequence == 1)
        assert set(rec.view.counts) == {(0, be(100)), (0, be(101))}
        resets = {
            reason: metric(bridge, "kvroute_bridge_resets_total", reason=reason)
            for reason in ("disconnect", "reconnect", "restart")
        }
        assert resets == {"disconnect": 1, "reconnect": 0, "restart": 0}

    run(main)


def test_seq_going_back_is_a_restart() -> None:
    # Drive the follower directly: a new engine whose first messages arrive with no
    # disconnect seen (e.g. behind a proxy) must still reset the view.
    async def main(rig: Rig) -> None:
        bridge = await rig.bridge(rig.engine(replay=False).endpoints())
        for seq in range(3):
            await new_engine_batch(bridge, seq, seq + 1)
        await new_engine_batch(bridge, 0, 50)
        state = bridge.streams[0].state
        assert state.blocks == 1 and state.copies(0, be(50)) == 1 and state.last_sequence == 0
        assert metric(bridge, "kvroute_bridge_resets_total", reason="restart") == 1

    run(main)


def test_bridge_joins_running_engine_through_replay() -> None:
    async def main(rig: Rig) -> None:
        engine = rig.engine()
        for i in range(5):  # published before the bridge existed
            await engine.publish([store([i + 1], i or None, TOKENS[:16])])
        bridge = await rig.bridge(engine.endpoints())
        rec = rig.recorder(bridge)
        await connected(bridge)
        await engine.publish([store([6], 5, TOKENS[:16])])
        await rec.wait_for(lambda: rec.position.sequence == 5)
        assert engine.replay_requests == [0] and len(rec.view.counts) == 6

    run(main)


def test_bridge_beside_a_quiet_engine_takes_its_buffer_without_a_new_batch() -> None:
    async def main(rig: Rig) -> None:
        engine, _, rec = await rig.beside_quiet_engine(5)
        assert engine.replay_requests == [0] and len(rec.view.counts) == 5
        await engine.publish([store([6], 5, TOKENS[:16])])  # then live, in order
        await rec.wait_for(lambda: rec.position.sequence == 5)
        assert engine.replay_requests == [0] and len(rec.view.counts) == 6

    run(main)


def test_live_copies_of_an_idle_joins_replay_are_not_a_restart() -> None:
    # A bridge beside a quiet engine takes its buffer through the replay; the live copies of
    # those batches may still be in flight and arrive afterwards. They are duplicates, not a
    # restarted engine reusing the seqs, whose batches are told apart by their payloads.
    async def main(rig: Rig) -> None:
        engine, bridge, rec = await rig.beside_quiet_engine(3)
        follower, stream_id = bridge.followers[0], rec.position.stream_id
        for seq, payload in list(engine.buffer):  # the in-flight live copies
            await follower.on_live(s.live_frames("kv", seq, payload))
        assert metric(bridge, "kvroute_bridge_resets_total", reason="restart") == 0
        state = bridge.streams[0].state
        assert state.last_sequence == 2 and state.blocks == 3
        # a new engine (no disconnect seen) publishing its first batch after the live copies
        await new_engine_batch(bridge, 0, 50)
        assert metric(bridge, "kvroute_bridge_resets_total", reason="restart") == 1
        await rec.wait_for(lambda: set(rec.view.counts) == {(0, be(50))})
        assert rec.position.stream_id != stream_id

    run(main)


def test_digests_of_an_idle_join_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    # At the bound the oldest digests go: a live copy older than the kept ones counts as a
    # restart (a needless reset, never a wrong view); the newest are still recognised.
    monkeypatch.setattr(follower_module, "_REPLAYED_DIGESTS_MAX", 2)

    async def main(rig: Rig) -> None:
        engine, bridge, rec = await rig.beside_quiet_engine(4)
        follower, copies = bridge.followers[0], dict(engine.buffer)
        assert sorted(follower._replayed) == [2, 3]
        assert follower._is_replayed_copy(3, copies[3])
        await follower.on_live(s.live_frames("kv", 0, copies[0]))
        assert metric(bridge, "kvroute_bridge_resets_total", reason="restart") == 1
        await rec.wait_for(lambda: set(rec.view.counts) == {(0, be(1))})

    run(main)


def test_a_restarted_engines_first_batch_after_an_idle_join_is_a_restart() -> None:
    # The digests kept from the replay match only the very batches it delivered: a new engine
    # that reuses seq 0 with another payload is a restart even before any live message.
    async def main(rig: Rig) -> None:
        _, bridge, rec = await rig.beside_quiet_engine(2)
        await new_engine_batch(bridge, 0, 50)
        assert metric(bridge, "kvroute_bridge_resets_total", reason="restart") == 1
        await rec.wait_for(lambda: set(rec.view.counts) == {(0, be(50))})

    run(main)


def test_malformed_messages_reset_and_are_counted() -> None:
    async def main(rig: Rig) -> None:
        engine, bridge, rec = await rig.follow(replay=False)
        good = s.encode_batch(1.0, [store([1], None, TOKENS[:16])], 0, "0.33")
        wrong_types = s.encode_batch(1.0, [], 0, "0.33").replace(b"\x00", b"\xc3")
        bad = [
            [b"kv", s.seq_frame(1)],  # wrong frame count
            [b"kv", b"\x00\x01", good],  # short seq frame
            [b"kv", s.seq_frame(1), b"\xc1garbage"],  # undecodable payload
            [b"kv", s.seq_frame(2), wrong_types],  # wrong types (dp rank is a bool)
        ]
        await engine.send_raw(s.live_frames("kv", 0, good))
        for frames in bad:
            await engine.send_raw(frames)
        await engine.send_raw(s.live_frames("kv", 3, good))
        await rec.wait_for(lambda: rec.position.sequence == 3)
        assert metric(bridge, "kvroute_bridge_malformed_frames_total", problem="frames") == 1
        assert metric(bridge, "kvroute_bridge_malformed_frames_total", problem="seq") == 1
        assert metric(bridge, "kvroute_bridge_malformed_frames_total", problem="payload") == 2
        assert metric(bridge, "kvroute_bridge_resets_total", reason="malformed") == 4
        assert [snap.reason for snap in rec.snapshots()][-1] == "malformed"
        assert set(rec.view.counts) == {(0, be(1))}  # only the last good batch survives
        assert bridge.streams[0].state.last_sequence == 3

    run(main)


def test_engine_never_started_is_healthy_but_not_ready() -> None:
    async def main(rig: Rig) -> None:
        probe = rig.ctx.socket(zmq.PUB)
        port = probe.bind_to_random_port("tcp://127.0.0.1")
        probe.close(linger=0)  # a free port nobody listens on
        await asyncio.sleep(0.1)
        bridge = await rig.bridge(EngineEndpoints(0, f"tcp://127.0.0.1:{port}", None, "kv"))
        rec = rig.recorder(bridge)
        await rec.wait_for(lambda: len(rec.snapshots()) == 1)
        async with httpx.AsyncClient() as http:
            base = f"http://127.0.0.1:{bridge.http_port}"
            await asyncio.sleep(0.5)
            health = await http.get(f"{base}/health")
            assert health.status_code == 200 and health.json()["ready"] is False
            assert (await http.get(f"{base}/ready")).status_code == 503
            engine = rig.engine(replay=False, pub_port=port)  # the engine comes up late
            await connected(bridge)
            assert (await http.get(f"{base}/ready")).status_code == 200
        await engine.publish([store([7], None, TOKENS[:16])])
        await rec.wait_for(lambda: (0, be(7)) in rec.view.counts)

    run(main)


def test_slow_subscriber_is_resynchronised_without_blocking_others() -> None:
    async def main(rig: Rig) -> None:
        import grpc.aio

        from kvroute.proto.events_pb2 import SubscribeRequest, SubscribeResponse

        engine = rig.engine(replay=False)
        bridge = await rig.bridge(engine.endpoints(), limits=StreamLimits(queue_size=16))
        fast = rig.recorder(bridge)
        # A small fixed flow-control window, so that not reading stalls the stream quickly.
        target = f"127.0.0.1:{bridge.grpc_port}"
        channel = grpc.aio.insecure_channel(target, options=[("grpc.http2.bdp_probe", 0)])
        method = channel.unary_stream(
            "/kvroute.v1.KvEvents/Subscribe",
            request_serializer=SubscribeRequest.SerializeToString,
            response_deserializer=SubscribeResponse.FromString,
        )
        slow = method(SubscribeRequest())  # not read until the end
        await connected(bridge)
        big = list(range(16 * 512))
        count = 60
        for i in range(count):
            hashes = [i * 1000 + j for j in range(512)]
            await engine.publish([store(hashes, None, big)])
            # Paced like engine steps, so that a reading subscriber keeps up even on a
            # loaded machine; the one that does not read overflows all the same.
            await fast.wait_for(lambda i=i: fast.position.sequence == i, timeout=10)
        await fast.wait_for(lambda: fast.position.sequence == count - 1, timeout=30)
        assert len(fast.snapshots()) == 1  # never resynchronised
        assert metric(bridge, "kvroute_bridge_lagging_subscribers_total") >= 1
        view, reasons = View(), []
        async for message in slow:
            if message.HasField("snapshot"):
                reasons.append(message.snapshot.reason)
                view.replace(message.snapshot.events)
                last = message.snapshot.sequence
            else:
                view.apply(message.batch.events)
                last = message.batch.sequence
            if last == count - 1:
                break
        assert "lagging" in reasons and view.counts == fast.view.counts
        slow.cancel()
        await channel.close()

    run(main)


def test_resume_same_bridge_and_snapshot_after_bridge_restart() -> None:
    async def main(rig: Rig) -> None:
        engine, bridge, rec = await rig.follow()
        await engine.publish([store([1], None, TOKENS[:16])])
        await rec.wait_for(lambda: rec.position.sequence == 0)
        await rec.close()
        await engine.publish([store([2], 1, TOKENS[16:32])])
        await engine.publish([store([3], 2, TOKENS[32:48])])
        position = ResumePoint(rec.position.stream_id, rec.position.sequence)
        resumed = rig.recorder(bridge, position=position)
        await resumed.wait_for(lambda: resumed.position.sequence == 2)
        assert not resumed.snapshots()  # only the two missed batches
        assert [b.sequence for b in resumed.batches()] == [1, 2]
        await resumed.close()
        assert metric(bridge, "kvroute_bridge_resumes_total") == 1
        # A new bridge process: the stream id changed, so the subscriber gets a snapshot.
        await bridge.stop()
        bridge2 = await rig.bridge(engine.endpoints())
        after = rig.recorder(bridge2, position=resumed.position)
        await after.wait_for(lambda: len(after.snapshots()) == 1)
        assert after.snapshots()[0].reason == "resume_unavailable"
        await connected(bridge2)
        await engine.publish([store([4], 3, TOKENS[48:64])])
        # bridge2 joined through replay from 0: the whole history, then the new batch
        await after.wait_for(lambda: after.position.sequence == 3)
        assert len(after.view.counts) == 4

    run(main)


def test_data_parallel_ranks_are_separate_streams() -> None:
    async def main(rig: Rig) -> None:
        engines = [rig.engine(dp_rank=r) for r in (0, 1)]
        bridge = await rig.bridge(*(e.endpoints() for e in engines))
        recs = [rig.recorder(bridge, dp_rank=r) for r in (0, 1)]
        await connected(bridge)
        await engines[0].publish([store([1], None, TOKENS[:16])])
        await engines[1].publish([store([2], None, TOKENS[:16])])
        await engines[1].publish([store([3], 2, TOKENS[16:32])])
        await recs[0].wait_for(lambda: recs[0].position.sequence == 0)
        await recs[1].wait_for(lambda: recs[1].position.sequence == 1)
        assert set(recs[0].view.counts) == {(0, be(1))}
        assert set(recs[1].view.counts) == {(0, be(2)), (0, be(3))}
        assert (
            recs[1].batches()[0].dp_rank == 1
            and recs[0].position.stream_id != recs[1].position.stream_id
        )

    run(main)


def test_client_reconnects_to_a_restarted_bridge_and_gets_a_snapshot() -> None:
    async def main(rig: Rig) -> None:
        engine = rig.engine()
        first = Bridge(
            BridgeConfig(
                engines=(engine.endpoints(),),
                listen="127.0.0.1:0",
                http="127.0.0.1:0",
                replay_timeout=1.0,
            )
        )
        await first.start()
        port = first.grpc_port
        rec = rig.recorder(first)  # keeps running across the bridge restart
        await connected(first)
        await engine.publish([store([1], None, TOKENS[:16])])
        await rec.wait_for(lambda: rec.position.sequence == 0)
        first_id = rec.position.stream_id
        await first.stop()
        bridge = await rig.bridge(engine.endpoints(), listen=f"127.0.0.1:{port}")
        await rec.wait_for(lambda: rec.position.stream_id not in ("", first_id))
        assert rec.snapshots()[-1].reason == "resume_unavailable"
        await connected(bridge)
        await engine.publish([store([2], 1, TOKENS[16:32])])
        await rec.wait_for(lambda: (0, be(2)) in rec.view.counts)
        assert set(rec.view.counts) == {(0, be(1)), (0, be(2))}  # history joined via replay

    run(main)


def test_a_salted_stream_carries_the_salts_digest_never_the_salt() -> None:
    salt_a, salt_b = "tenant-a-secret-0f3c9e", "tenant-b-secret-77d1aa"

    async def main(rig: Rig) -> None:
        engine, bridge, live = await rig.follow()
        await engine.publish([store([1], None, TOKENS[:16], extra_keys=[(salt_a,)])])
        await engine.publish([store([2], None, TOKENS[:16], extra_keys=[(salt_b,)])])
        await engine.publish([store([3], None, TOKENS[:16])])
        await live.wait_for(lambda: (0, be(3)) in live.view.counts)
        late = rig.recorder(bridge)  # a snapshot of the same blocks
        await late.wait_for(lambda: (0, be(3)) in late.view.counts)
        wire = b"".join(m.SerializeToString() for m in [*live.messages, *late.messages])
        for salt in (salt_a, salt_b):
            assert salt.encode() not in wire
            assert salt_namespace(salt).encode() in wire
        # what a router's index makes of it: each tenant finds only its own block
        view = FleetIndexView(hash_unit=16)
        view.apply_snapshot("w", late.snapshots()[-1])
        prompt = TOKENS[:17]
        assert view.score(prompt, cache_salt=salt_a)["w"] == 16
        assert view.score(prompt, cache_salt=salt_b)["w"] == 16
        assert view.score(prompt, cache_salt="tenant-c")["w"] == 0
        view.remove_worker("w")
        view.apply_snapshot("w", _only(late.snapshots()[-1], be(1)))
        assert view.score(prompt, cache_salt=salt_a)["w"] == 16
        assert view.score(prompt, cache_salt=salt_b)["w"] == 0
        assert view.score(prompt)["w"] == 0

    run(main)


def _only(snapshot: Any, block: bytes) -> Any:
    """`snapshot` with only the stores of `block`."""
    kept = type(snapshot)()
    kept.CopyFrom(snapshot)
    del kept.events[:]
    kept.events.extend(e for e in snapshot.events if block in e.block_hashes)
    return kept


def test_a_failing_follower_is_restarted_and_liveness_fails_if_it_cannot_recover() -> None:
    async def main(rig: Rig) -> None:
        engine, bridge, rec = await rig.follow(replay=False)
        follower = bridge.followers[0]
        real = follower.on_live
        failures = [1]  # the next live message fails once

        async def flaky(frames: Any) -> None:
            if failures[0]:
                failures[0] -= 1
                raise RuntimeError("injected")
            await real(frames)

        follower.on_live = flaky  # type: ignore[method-assign]
        base = f"http://127.0.0.1:{bridge.http_port}"
        async with httpx.AsyncClient() as http:
            await engine.publish([store([1], None, TOKENS[:16])])
            await eventually(lambda: metric(bridge, "kvroute_bridge_follower_restarts_total") == 1)
            await connected(bridge)
            await engine.publish([store([2], None, TOKENS[:16])])
            await rec.wait_for(lambda: (0, be(2)) in rec.view.counts)
            assert (await http.get(f"{base}/livez")).status_code == 200
            assert (await http.get(f"{base}/readyz")).status_code == 200
            # now it fails on every message: after follower_recovery_s, liveness says so
            failures[0] = 10**9
            deadline = asyncio.get_running_loop().time() + 10
            while (await http.get(f"{base}/livez")).status_code == 200:
                assert asyncio.get_running_loop().time() < deadline, "liveness never failed"
                await engine.publish([store([3], None, TOKENS[:16])])
                await asyncio.sleep(0.1)
            assert metric(bridge, "kvroute_bridge_follower_restarts_total") >= 3
            assert (await http.get(f"{base}/health")).json()["status"] == "failing"

    run(main)
