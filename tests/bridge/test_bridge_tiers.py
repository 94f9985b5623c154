"""Lower KV tiers in the bridge: separate views, snapshot, bounds, metrics (spec §10)."""

from __future__ import annotations

from typing import Any

from kvroute.bridge.metrics import BridgeMetrics
from kvroute.bridge.state import EngineState
from kvroute.bridge.stream import RankStream
from kvroute.proto.events_pb2 import KvEventBatch, KvGroupEvent, Tier

STORE, REMOVE, CLEAR, INVALID = (
    KvGroupEvent.STORE,
    KvGroupEvent.REMOVE,
    KvGroupEvent.CLEAR,
    KvGroupEvent.INVALID,
)
BS = 4


def hb(i: int) -> bytes:
    return i.to_bytes(8, "big")


def store(first: int, count: int, tier: int = Tier.GPU, **kw: Any) -> KvGroupEvent:
    """A dense chain of `count` blocks, hashes first..first+count-1, parent first-1."""
    return KvGroupEvent(
        operation=STORE,
        block_hashes=[hb(first + i) for i in range(count)],
        parent_block_hash=hb(first - 1) if first else b"",
        token_ids=list(range(first * BS, (first + count) * BS)),
        block_size=BS,
        kind="full_attention",
        tier=tier,
        **kw,
    )


def batch(seq: int, *events: KvGroupEvent) -> KvEventBatch:
    out = KvEventBatch(sequence=seq)
    for event in events:
        (out.events if event.tier == Tier.GPU else out.tier_events).append(event)
    return out


def cpu(state: EngineState, i: int) -> int:
    view = state.tier(Tier.CPU)
    return 0 if view is None else view.copies(0, hb(i))


def test_tiers_are_separate_views() -> None:
    state = EngineState()
    state.apply(batch(0, store(0, 4), store(0, 6, Tier.CPU), store(0, 2, Tier.STORAGE)))
    assert [state.copies(0, hb(i)) for i in range(6)] == [1, 1, 1, 1, 0, 0]
    assert [cpu(state, i) for i in range(6)] == [1] * 6
    storage = state.tier(Tier.STORAGE)
    assert storage is not None and storage.blocks == 2
    # A CPU eviction leaves the GPU copy; a GPU eviction leaves the CPU copy.
    state.apply(
        batch(
            1,
            KvGroupEvent(operation=REMOVE, block_hashes=[hb(3)]),
            KvGroupEvent(operation=REMOVE, block_hashes=[hb(0)], tier=Tier.CPU),
        )
    )
    assert state.copies(0, hb(3)) == 0 and cpu(state, 3) == 1
    assert state.copies(0, hb(0)) == 1 and cpu(state, 0) == 0


def test_a_tier_invalid_discards_that_tier_only_and_clear_empties_all() -> None:
    state = EngineState()
    state.apply(batch(0, store(0, 2), store(0, 2, Tier.CPU), store(0, 2, Tier.STORAGE)))
    state.apply(batch(1, KvGroupEvent(operation=INVALID, tier=Tier.CPU)))
    assert state.blocks == 2 and cpu(state, 0) == 0
    storage = state.tier(Tier.STORAGE)
    assert storage is not None and storage.blocks == 2
    state.apply(batch(2, store(0, 2, Tier.CPU), KvGroupEvent(operation=INVALID)))
    assert state.blocks == 0 and cpu(state, 0) == 1
    state.apply(batch(3, store(0, 2), KvGroupEvent(operation=CLEAR)))
    assert state.blocks == 0 and cpu(state, 0) == 0 and storage.blocks == 0


def test_a_contradiction_in_a_tier_is_marked_in_that_tier_only() -> None:
    state = EngineState()
    state.apply(batch(0, store(0, 2), store(0, 2, Tier.CPU)))
    clash = store(10, 1, Tier.CPU)
    clash.kind, clash.sliding_window = "sliding_window", 8
    sent = state.apply(batch(1, store(2, 1), clash))
    assert [e.operation for e in sent.events] == [STORE]
    assert [(e.operation, e.tier) for e in sent.tier_events] == [
        (INVALID, Tier.CPU),
        (STORE, Tier.CPU),
    ]
    assert state.blocks == 3 and cpu(state, 0) == 0 and cpu(state, 10) == 1


def test_unknown_tiers_are_ignored() -> None:
    state = EngineState()
    event = store(0, 2, Tier.CPU)
    event.tier = 7  # type: ignore[assignment]
    state.apply(batch(0, event))
    assert state.tiers == {}


def test_snapshot_carries_every_tier_and_is_unchanged_without_tiers() -> None:
    plain, tiered = EngineState(), EngineState()
    plain.apply(batch(0, store(0, 3)))
    tiered.apply(batch(0, store(0, 3), store(0, 5, Tier.CPU)))
    assert not plain.snapshot().tier_events and not plain.snapshot().tier_lineage
    snap = tiered.snapshot()
    assert list(snap.events) == list(plain.snapshot().events)
    assert {e.tier for e in snap.tier_events} == {Tier.CPU}
    assert [h for e in snap.tier_events for h in e.block_hashes] == [hb(i) for i in range(5)]
    rebuilt = EngineState()
    replay = KvEventBatch(sequence=1)
    replay.events.extend(snap.events)
    replay.tier_events.extend(snap.tier_events)
    rebuilt.apply(replay)
    assert [cpu(rebuilt, i) for i in range(5)] == [1] * 5 and rebuilt.blocks == 3


def test_each_tier_has_its_own_bound() -> None:
    state = EngineState(max_blocks=4)
    state.apply(batch(0, store(0, 3)))
    for seq in range(1, 5):
        state.apply(batch(seq, store(100 * seq, 2, Tier.CPU)))
    view = state.tier(Tier.CPU)
    assert view is not None
    assert view.blocks <= 4 and view.stats.evicted_blocks == 4
    assert view.copies(0, hb(400)) == 1 and view.copies(0, hb(100)) == 0  # oldest dropped
    assert state.blocks == 3 and state.stats.evicted_blocks == 0


def test_metrics_count_events_and_blocks_per_tier() -> None:
    metrics = BridgeMetrics()
    stream = RankStream(0, "b", EngineState(), metrics)

    def sample(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, {"dp_rank": "0", **labels}) or 0.0

    stream.apply(batch(0, store(0, 2), store(0, 4, Tier.CPU), store(9, 1, Tier.CPU)))
    stream.apply(batch(1, KvGroupEvent(operation=REMOVE, block_hashes=[hb(9)], tier=Tier.CPU)))
    events = "kvroute_bridge_tier_events_total"
    assert sample(events, tier="gpu", kind="store") == 1
    assert sample(events, tier="cpu", kind="store") == 2
    assert sample(events, tier="cpu", kind="remove") == 1
    assert sample("kvroute_bridge_state_tier_blocks", tier="gpu") == 2
    assert sample("kvroute_bridge_state_tier_blocks", tier="cpu") == 4
    # The GPU-only counter keeps its meaning.
    assert sample("kvroute_bridge_events_total", kind="store") == 1
