"""Batch-level ingest: a busy engine's runs of one-hash REMOVEs and its releases reach the
presence sink as one call each, with the result of applying them one at a time."""

from __future__ import annotations

import random

from kvroute.indexer import GroupCache
from kvroute.indexer.inverted import InvertedIndex, WorkerSink
from kvroute.indexer.lineage import Lineage
from kvroute.indexer.presence import DictSink
from tests.indexer.events import FULL, batch, clear, engine_hashes, remove, store

RNG = random.Random(11)
P = [RNG.randrange(1000, 9000) for _ in range(200)]
H = engine_hashes(P)


def full(hashes: list[bytes], start: int = 0) -> object:
    parent = H[start - 1] if start else b""
    n = len(hashes)
    return store(0, hashes, P[start * 16 : (start + n) * 16], 16, FULL, parent=parent)


class CountingSink(DictSink):
    """A `DictSink` that counts per-key and bulk calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def discard(self, slot: int, key: int) -> bool:
        self._count("discard")
        return super().discard(slot, key)

    def discard_all(self, slot: int, keys: list[int]) -> list[bool]:
        self._count("discard_all")
        return [super(CountingSink, self).discard(slot, key) for key in keys]

    def holds(self, key: int) -> bool:
        self._count("holds")
        return super().holds(key)

    def holds_all(self, keys: list[int]) -> list[bool]:
        self._count("holds_all")
        return [super(CountingSink, self).holds(key) for key in keys]


def test_a_run_of_removes_reaches_the_sink_in_one_call_and_releases_in_one() -> None:
    sink = CountingSink()
    lin = Lineage(sink, 16, 1000, 1000)
    lin.apply_batch(batch(0, full(H[:8])).events)
    sink.calls.clear()
    lin.apply_batch(batch(1, *[remove(0, [h]) for h in H[2:8]]).events)
    assert sink.calls == {"discard_all": 1, "holds_all": 1}
    assert lin.entries == 2 and sink.present(0) == 2


def test_removes_stay_in_order_around_the_stores_between_them() -> None:
    gc = GroupCache()
    gc.apply(batch(0, full(H[:6])))
    # H[5]: one copy removed, stored again, removed again: none left (reordering the two
    # removes before the store would leave one)
    gc.apply(batch(1, remove(0, [H[5]]), full([H[5]], 5), remove(0, [H[5]])))
    assert gc.reusable_tokens(P[:97]) == 80
    # a run across two groups: group 1 is unknown, its REMOVE withdraws nothing of group 0
    gc.apply(batch(2, remove(0, [H[4]]), remove(1, [H[3]]), remove(0, [H[3]])))
    assert gc.reusable_tokens(P[:97]) == 48


def test_a_clear_after_removes_in_one_batch_releases_each_block_once() -> None:
    gc = GroupCache()
    gc.apply(batch(0, full(H[:6])))
    gc.apply(batch(1, remove(0, [H[2]]), clear()))  # H[2] is a candidate and in the view
    st = gc.stats()
    assert gc.reusable_tokens(P[:97]) == 0 and st.entries == 0 and st.valid


def test_fleet_sink_bulk_calls_equal_one_key_at_a_time() -> None:
    rng = random.Random(3)
    keys = [rng.randrange(1 << 70) for _ in range(40)]
    bulk, single = InvertedIndex(), InvertedIndex()
    sinks = [(WorkerSink(bulk, i), WorkerSink(single, i)) for i in range(3)]
    for a, b in sinks:
        a.add_slot(0)
        b.add_slot(0)
    for _ in range(300):
        a, b = rng.choice(sinks)
        chosen = rng.choices(keys, k=rng.randrange(1, 8))  # repeats: copies, shared bitsets
        op = rng.randrange(3)
        if op == 0:
            a.add_all(0, chosen)
            for key in chosen:
                b.add(0, key)
        elif op == 1:
            assert a.discard_all(0, chosen) == [b.discard(0, key) for key in chosen]
        else:
            assert a.holds_all(chosen) == [b.holds(key) for key in chosen]
        assert bulk.slots == single.slots
        assert a.present(0) == b.present(0)
    assert bulk.shared_bitsets() == single.shared_bitsets()
