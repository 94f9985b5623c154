"""Event subscriptions against the bridge's real gRPC service on loopback (its RankStream fed
directly, no engine): snapshot then batches, loss and resume, resync from a snapshot."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from kvroute.bridge.metrics import BridgeMetrics
from kvroute.bridge.server import kv_events_handler, start_grpc_server
from kvroute.bridge.state import EngineState
from kvroute.bridge.stream import RankStream
from kvroute.proto import events_pb2
from kvroute.router.config import BreakerConfig, EventsConfig, WorkerSpec
from kvroute.router.fleet.event_subscriptions import LIVE, LOST, EventSubscriptions
from kvroute.router.fleet.workers import WorkerRegistry
from kvroute.router.ops.metrics import RouterMetrics
from tests.router.fakes import ScriptedIndex

OP = events_pb2.KvGroupEvent


def batch(seq: int, first_token: int) -> events_pb2.KvEventBatch:
    store = OP(
        operation=OP.STORE,
        group_id=0,
        block_hashes=[seq.to_bytes(8, "big")],
        token_ids=list(range(first_token, first_token + 16)),
        block_size=16,
        kind="full_attention",
    )
    return events_pb2.KvEventBatch(sequence=seq, timestamp=0.0, events=[store])


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


class FakeBridge:
    """The bridge's gRPC server over one RankStream that the test feeds."""

    def __init__(self) -> None:
        self.stream = RankStream(0, "test-bridge", EngineState(0), BridgeMetrics())
        self.server: Any = None
        self.port = 0

    async def start(self, port: int = 0) -> None:
        handler = kv_events_handler(lambda rank: self.stream if rank == 0 else None)
        self.server, self.port = await start_grpc_server(f"127.0.0.1:{port}", handler)

    async def stop(self) -> None:
        await self.server.stop(grace=None)


def run(fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(fn())


def test_snapshot_batches_loss_resume_and_resync() -> None:
    async def go() -> None:
        bridge = FakeBridge()
        await bridge.start()
        bridge.stream.apply(batch(1, 0))  # already cached before the router subscribes
        index = ScriptedIndex()
        metrics = RouterMetrics()
        events = EventSubscriptions(
            index, EventsConfig(reconnect_initial_s=0.05, reconnect_max_s=0.1), metrics
        )
        registry = WorkerRegistry(BreakerConfig())
        registry.listen(events)
        registry.add(
            WorkerSpec(name="w0", url="http://127.0.0.1:1", bridge=f"127.0.0.1:{bridge.port}")
        )
        assert "w0" in events.unusable()  # nothing known yet
        await events.start()
        try:
            # the index records a snapshot when its apply starts; live comes when it ends
            await until(lambda: index.snapshots == [("w0", "initial")])
            await until(lambda: events.status("w0").state == LIVE)  # type: ignore[union-attr]
            status = events.status("w0")
            assert status is not None and status.state == LIVE and "w0" not in events.unusable()
            bridge.stream.apply(batch(2, 16))
            bridge.stream.apply(batch(3, 32))
            await until(lambda: index.batches == [("w0", 2), ("w0", 3)])
            assert status.last_sequence == 3

            # the bridge goes away: the view is kept but not trusted
            await bridge.stop()
            await until(lambda: status.state == LOST)
            assert "w0" in events.unusable() and index.invalidated == []
            bridge.stream.apply(batch(4, 48))  # happens while the router is away
            await bridge.start(bridge.port)
            # resumed after 3: only the missed batch, no snapshot
            await until(lambda: ("w0", 4) in index.batches)
            assert len(index.snapshots) == 1 and status.state == LIVE
            assert "w0" not in events.unusable()

            # drift detected elsewhere: discard and start from a snapshot
            assert events.resync("w0")
            assert index.invalidated == ["w0"]
            await until(lambda: len(index.snapshots) == 2 and status.state == LIVE)
            assert index.snapshots[-1] == ("w0", "initial") and status.state == LIVE
            assert not events.resync("nope")

            registry.remove("w0")
            assert index.removed == ["w0"] and events.status("w0") is None
        finally:
            await events.stop()
            await bridge.stop()
        text = metrics.registry.get_sample_value(
            "kvroute_event_stream_lost_total", {"worker": "w0"}
        )
        assert text == 1

    run(go)


def test_resume_impossible_gets_a_snapshot() -> None:
    async def go() -> None:
        bridge = FakeBridge()
        await bridge.start()
        bridge.stream.apply(batch(1, 0))
        index = ScriptedIndex()
        events = EventSubscriptions(
            index, EventsConfig(reconnect_initial_s=0.05, reconnect_max_s=0.1), RouterMetrics()
        )
        registry = WorkerRegistry(BreakerConfig())
        registry.listen(events)
        registry.add(
            WorkerSpec(name="w0", url="http://127.0.0.1:1", bridge=f"127.0.0.1:{bridge.port}")
        )
        await events.start()
        try:
            await until(lambda: len(index.snapshots) == 1)
            await bridge.stop()
            bridge.stream.reset("restart")  # the engine restarted: a new stream id
            bridge.stream.apply(batch(1, 100))
            await bridge.start(bridge.port)
            await until(lambda: len(index.snapshots) == 2)
            assert index.snapshots[-1] == ("w0", "resume_unavailable")
        finally:
            await events.stop()
            await bridge.stop()

    run(go)


def test_unreachable_bridge_stays_unusable() -> None:
    async def go() -> None:
        index = ScriptedIndex()
        events = EventSubscriptions(
            index, EventsConfig(reconnect_initial_s=0.05, reconnect_max_s=0.1), RouterMetrics()
        )
        registry = WorkerRegistry(BreakerConfig())
        registry.listen(events)
        await events.start()
        registry.add(WorkerSpec(name="w0", url="http://127.0.0.1:1", bridge="127.0.0.1:1"))
        try:
            await until(lambda: (events.status("w0") or events).reconnects >= 2)  # type: ignore[union-attr]
            assert "w0" in events.unusable() and index.snapshots == []
        finally:
            await events.stop()

    run(go)


def test_a_message_the_index_rejects_resynchronises() -> None:
    class BrokenOnce(ScriptedIndex):
        failed = False

        def apply(self, worker: str, batch: events_pb2.KvEventBatch) -> None:
            if not self.failed:
                self.failed = True
                raise ValueError("indexer bug")
            super().apply(worker, batch)

    async def go() -> None:
        bridge = FakeBridge()
        await bridge.start()
        index = BrokenOnce()
        metrics = RouterMetrics()
        events = EventSubscriptions(
            index, EventsConfig(reconnect_initial_s=0.05, reconnect_max_s=0.1), metrics
        )
        registry = WorkerRegistry(BreakerConfig())
        registry.listen(events)
        registry.add(
            WorkerSpec(name="w0", url="http://127.0.0.1:1", bridge=f"127.0.0.1:{bridge.port}")
        )
        await events.start()
        try:
            await until(lambda: len(index.snapshots) == 1)
            bridge.stream.apply(batch(1, 0))  # the index raises on this one
            await until(lambda: len(index.snapshots) == 2)  # fresh subscription, snapshot
            assert index.invalidated == ["w0"]
            bridge.stream.apply(batch(2, 16))
            await until(lambda: ("w0", 2) in index.batches)
            assert (
                metrics.registry.get_sample_value(
                    "kvroute_index_resyncs_total", {"worker": "w0", "cause": "apply_error"}
                )
                == 1
            )
        finally:
            await events.stop()
            await bridge.stop()

    run(go)


def test_a_large_snapshot_is_applied_in_steps_between_other_work() -> None:
    """The loop serves other tasks in the middle of a big snapshot (real index)."""
    from kvroute.router.routing.fleet_index_view import FleetIndexView

    class Counting(FleetIndexView):
        steps = 0

        def apply_snapshot_steps(
            self, worker: str, snapshot: events_pb2.Snapshot, blocks_per_step: int
        ) -> Iterator[None]:
            for _ in super().apply_snapshot_steps(worker, snapshot, blocks_per_step):
                self.steps += 1
                yield

    async def go() -> None:
        bridge = FakeBridge()
        await bridge.start()
        blocks = 4096
        big = OP(
            operation=OP.STORE,
            group_id=0,
            block_hashes=[(i + 1).to_bytes(8, "big") for i in range(blocks)],
            token_ids=[i % 50_000 for i in range(16 * blocks)],
            block_size=16,
            kind="full_attention",
        )
        bridge.stream.apply(events_pb2.KvEventBatch(sequence=1, events=[big]))
        index = Counting(16)
        cfg = EventsConfig(reconnect_initial_s=0.05, snapshot_step_blocks=256)
        events = EventSubscriptions(index, cfg, RouterMetrics())
        registry = WorkerRegistry(BreakerConfig())
        registry.listen(events)
        registry.add(
            WorkerSpec(name="w0", url="http://127.0.0.1:1", bridge=f"127.0.0.1:{bridge.port}")
        )
        seen: list[int] = []

        async def ticker() -> None:
            while True:
                seen.append(index.steps)
                await asyncio.sleep(0)

        tick = asyncio.create_task(ticker())
        await events.start()
        try:
            await until(lambda: "w0" not in events.unusable())
            assert index.score(list(range(16 * 8)))["w0"] == 112  # the snapshot is in
            total = index.steps
            assert total >= blocks // 256  # one step per 256 blocks (the event is cut)
            assert any(0 < s < total for s in seen)  # other tasks ran in between
        finally:
            tick.cancel()
            await events.stop()
            await bridge.stop()

    run(go)


def test_a_resume_with_nothing_missed_is_live_at_once() -> None:
    """The bridge sends its headers as soon as it accepts a subscription, so a router that
    resumes with nothing missed trusts its kept view again without waiting for a batch."""

    async def go() -> None:
        bridge = FakeBridge()
        await bridge.start()
        bridge.stream.apply(batch(1, 0))
        index = ScriptedIndex()
        events = EventSubscriptions(
            index, EventsConfig(reconnect_initial_s=0.05, reconnect_max_s=0.1), RouterMetrics()
        )
        registry = WorkerRegistry(BreakerConfig())
        registry.listen(events)
        registry.add(
            WorkerSpec(name="w0", url="http://127.0.0.1:1", bridge=f"127.0.0.1:{bridge.port}")
        )
        await events.start()
        try:
            await until(lambda: "w0" not in events.unusable())
            status = events.status("w0")
            assert status is not None
            await bridge.stop()
            await until(lambda: status.state == LOST)
            await bridge.start(bridge.port)  # the engine published nothing meanwhile
            await until(lambda: status.state == LIVE, timeout=3.0)
            assert "w0" not in events.unusable()
            assert len(index.snapshots) == 1 and index.batches == []  # resumed, nothing sent
        finally:
            await events.stop()
            await bridge.stop()

    run(go)


def test_a_live_batch_waits_the_apply_delay_and_a_backlog_does_not() -> None:
    """`apply_delay_s` lets a step's streamed tokens go out before its events are applied;
    batches that queue up meanwhile follow at once, not one delay each."""

    async def go() -> None:
        bridge = FakeBridge()
        await bridge.start()
        index = ScriptedIndex()
        delay = 0.3
        events = EventSubscriptions(
            index, EventsConfig(reconnect_initial_s=0.05, apply_delay_s=delay), RouterMetrics()
        )
        registry = WorkerRegistry(BreakerConfig())
        registry.listen(events)
        registry.add(
            WorkerSpec(name="w0", url="http://127.0.0.1:1", bridge=f"127.0.0.1:{bridge.port}")
        )
        await events.start()
        loop = asyncio.get_running_loop()
        try:
            await until(lambda: events.status("w0") is not None and index.snapshots != [])
            await asyncio.sleep(delay * 1.5)  # what follows the snapshot at once is a backlog
            t0 = loop.time()
            bridge.stream.apply(batch(1, 0))
            await asyncio.sleep(delay / 3)
            assert index.batches == []  # held back
            await until(lambda: index.batches == [("w0", 1)])
            assert loop.time() - t0 >= delay * 0.9

            await asyncio.sleep(delay * 2)  # quiet: the next batch is live again
            t0 = loop.time()
            for seq in (2, 3, 4, 5):
                bridge.stream.apply(batch(seq, 16 * seq))
            await until(lambda: len(index.batches) == 5)
            took = loop.time() - t0
            assert [s for _, s in index.batches] == [1, 2, 3, 4, 5]
            assert delay * 0.9 <= took < delay * 2.5  # one wait, not four
        finally:
            await events.stop()
            await bridge.stop()

    run(go)
