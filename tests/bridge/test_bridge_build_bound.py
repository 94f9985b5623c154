"""The bound on batches queued while a snapshot build reads a frozen state (a `RankStream`
driven directly): when they reach `queue_size` the build is given up, counted, and the
oldest batch applied; no batch is lost and the snapshots served after are right, lower
tiers included."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from typing import Any

import pytest

from kvroute.bridge import stream as stream_module
from kvroute.bridge.metrics import BridgeMetrics
from kvroute.bridge.state import EngineState
from kvroute.bridge.stream import RankStream, SnapshotBuilds, StreamLimits, Subscriber
from kvroute.proto.events_pb2 import (
    KvEventBatch,
    KvGroupEvent,
    SubscribeRequest,
    SubscribeResponse,
    Tier,
)

STORE, REMOVE = KvGroupEvent.STORE, KvGroupEvent.REMOVE
BS = 4
QUEUE = 8  # --queue-size: also the batches a build may fall behind by


def hb(i: int) -> bytes:
    return (i * 0x9E3779B97F4A7C15 % (1 << 64)).to_bytes(8, "big")


def store(first: int, count: int, tier: Any = Tier.GPU, **kw: Any) -> KvGroupEvent:
    """A dense chain of `count` blocks after block `first - 1` (none for 0)."""
    return KvGroupEvent(
        operation=STORE,
        block_hashes=[hb(first + i) for i in range(count)],
        parent_block_hash=hb(first - 1) if first else b"",
        token_ids=[(first * BS + i) % 30_000 for i in range(count * BS)],
        block_size=BS,
        kind=kw.pop("kind", "full_attention"),
        tier=tier,
        **kw,
    )


def remove(first: int, count: int, tier: Any = Tier.GPU) -> KvGroupEvent:
    hashes = [hb(first + i) for i in range(count)]
    return KvGroupEvent(operation=REMOVE, block_hashes=hashes, tier=tier)


def batch(seq: int, *events: KvGroupEvent) -> KvEventBatch:
    out = KvEventBatch(sequence=seq)
    for event in events:
        (out.events if event.tier == Tier.GPU else out.tier_events).append(event)
    return out


def held(state: EngineState) -> Counter[tuple[int, int, bytes]]:
    """(tier, group, hash) -> copies, every tier, as the state's snapshot gives them."""
    snap = state.snapshot()
    events = [*snap.events, *snap.tier_events]
    return Counter((e.tier, e.group_id, h) for e in events for h in e.block_hashes)


def drain(subscriber: Subscriber) -> list[SubscribeResponse]:
    out = []
    while not subscriber.queue.empty():
        out.append(SubscribeResponse.FromString(subscriber.queue.get_nowait()))
    return out


def replay(messages: list[SubscribeResponse]) -> tuple[EngineState, int]:
    """A fresh view built from a subscriber's messages: a snapshot then batches, each batch
    continuing the sequence (none lost, none repeated); the view and its last sequence."""
    first, *batches = messages
    assert first.WhichOneof("message") == "snapshot"
    snap = first.snapshot
    view = EngineState()
    start = KvEventBatch(sequence=snap.sequence)
    start.events.extend(snap.events)
    start.tier_events.extend(snap.tier_events)
    view.apply(start)
    last = snap.sequence
    for message in batches:
        assert message.WhichOneof("message") == "batch"
        assert message.batch.sequence == last + 1
        view.apply(message.batch)
        last = message.batch.sequence
    return view, last


def abandoned(metrics: BridgeMetrics, reason: str) -> float:
    value = metrics.registry.get_sample_value(
        "kvroute_bridge_snapshot_builds_abandoned_total", {"dp_rank": "0", "reason": reason}
    )
    return value or 0.0


def pending(metrics: BridgeMetrics) -> float:
    value = metrics.registry.get_sample_value(
        "kvroute_bridge_state_pending_batches", {"dp_rank": "0"}
    )
    return value or 0.0


def test_a_build_falling_queue_size_batches_behind_is_given_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A step of no time: the build yields after every step, so it is surely in flight
    # when the batches below arrive.
    monkeypatch.setattr(stream_module, "_STEP_S", 0.0)

    async def main() -> None:
        metrics = BridgeMetrics()
        builds = SnapshotBuilds(metrics=metrics)
        limits = StreamLimits(queue_size=QUEUE)
        stream = RankStream(0, "b", EngineState(0), metrics, limits, builds)
        engine = EngineState(0)  # the same batches, applied at once: what the engine holds
        seq = itertools.count()

        def push(*events: KvGroupEvent) -> None:
            sent = batch(next(seq), *events)
            stream.apply(sent)
            engine.apply(sent)

        for i in range(40):  # 2560 GPU and 640 CPU blocks: too large to build at once
            push(store(i * 64, 64), store(i * 64, 16, Tier.CPU))
        first = stream.subscribe(SubscribeRequest(dp_rank=0))
        for _ in range(100):
            if builds.running:
                break
            await asyncio.sleep(0)
        assert builds.running == 1 and first.queue.empty()  # waiting for the build

        # QUEUE + 1 batches while the state is frozen, without giving the build a turn:
        # stores and removes in both tiers, and a CPU group changing kind (an INVALID the
        # stream inserts ahead of the state).
        for k in range(QUEUE + 1):
            events = [store(100_000 + 4 * k, 4), remove(k * 64, 2)]
            events.append(store(200_000 + 4 * k, 4, Tier.CPU))
            if k == 3:
                events.append(store(300_000, 1, Tier.CPU, group_id=1, kind="mamba"))
            if k == 5:
                events.append(store(300_001, 1, Tier.CPU, group_id=1, kind="sliding_window"))
            push(*events)
            assert pending(metrics) < QUEUE  # the bound holds at every batch
        assert abandoned(metrics, "behind") == 1
        assert abandoned(metrics, "reset") == 0
        last = next(seq) - 1

        # The stream catches up, builds again and serves the waiting subscriber.
        for _ in range(500):
            if not first.queue.empty() and not builds.running and pending(metrics) == 0:
                break
            await asyncio.sleep(0.01)
        assert pending(metrics) == 0 and builds.running == 0
        assert stream.state.snapshot() == engine.snapshot()  # no batch lost by the state
        cpu = stream.state.tier(Tier.CPU)
        assert cpu is not None and cpu.groups == engine.tiers[Tier.CPU].groups
        view, seen = replay(drain(first))
        assert seen == last and held(view) == held(engine)  # none lost by the subscriber

        # A later subscriber gets the engine's whole view, every tier, as one snapshot.
        later = stream.subscribe(SubscribeRequest(dp_rank=0))
        for _ in range(500):
            if not later.queue.empty():
                break
            await asyncio.sleep(0.01)
        messages = drain(later)
        assert len(messages) == 1
        expected = engine.snapshot(stream_id=stream.stream_id, reason="initial")
        assert messages[0].snapshot == expected
        assert {e.tier for e in expected.tier_events} == {Tier.CPU}
        assert abandoned(metrics, "behind") == 1

    asyncio.run(asyncio.wait_for(main(), 60))
