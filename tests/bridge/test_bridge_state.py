"""The bridge's engine state: copy counts, snapshot lineage, bounds."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.state import EngineState
from proto.events_pb2 import KvEventBatch, KvGroupEvent, Snapshot

STORE, REMOVE, CLEAR, INVALID = (
    KvGroupEvent.STORE,
    KvGroupEvent.REMOVE,
    KvGroupEvent.CLEAR,
    KvGroupEvent.INVALID,
)
BS = 4


def h(path: tuple[int, ...]) -> bytes:
    """A stand-in engine hash: identifies a token prefix."""
    return (hash(path) & (2**64 - 1)).to_bytes(8, "big")


class View:
    """What a subscriber rebuilds (spec §8): copy counts and positions from dense stores."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[int, bytes]] = Counter()
        self.paths: dict[bytes, tuple[int, ...]] = {}
        self.pending: list[KvGroupEvent] = []

    def apply(self, events: Any) -> None:
        for ev in events:
            if ev.operation == STORE:
                for bh in ev.block_hashes:
                    self.counts[(ev.group_id, bh)] += 1
                if len(ev.token_ids) == len(ev.block_hashes) * ev.block_size and ev.block_hashes:
                    self.pending.append(ev)
                    self._resolve()
            elif ev.operation == REMOVE:
                for bh in ev.block_hashes:
                    key = (ev.group_id, bh)
                    if self.counts[key] > 0:
                        self.counts[key] -= 1
                    if self.counts[key] == 0:
                        del self.counts[key]
            elif ev.operation == CLEAR:
                self.counts.clear()
            else:
                self.counts.clear()
                self.paths.clear()
                self.pending.clear()

    def _resolve(self) -> None:
        progress = True
        while progress:
            progress = False
            for ev in list(self.pending):
                parent = ev.parent_block_hash
                if parent and parent not in self.paths:
                    continue
                path = self.paths[parent] if parent else ()
                tokens = list(ev.token_ids)
                for i, bh in enumerate(ev.block_hashes):
                    path = path + tuple(tokens[i * ev.block_size : (i + 1) * ev.block_size])
                    self.paths.setdefault(bh, path)
                self.pending.remove(ev)
                progress = True


def batch(seq: int, *events: dict[str, Any]) -> KvEventBatch:
    b = KvEventBatch(sequence=seq, timestamp=1.0)
    for ev in events:
        b.events.add(**ev)
    return b


def store(tokens: list[int], start: int, stop: int, group: int = 0, **kw: Any) -> dict[str, Any]:
    """Dense store of blocks [start, stop) of `tokens` (full-attention style)."""
    hashes = [h(tuple(tokens[: (i + 1) * BS])) for i in range(start, stop)]
    parent = h(tuple(tokens[: start * BS])) if start else b""
    return dict(
        operation=STORE,
        group_id=group,
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens[start * BS : stop * BS],
        block_size=BS,
        kind=kw.pop("kind", "full_attention"),
        **kw,
    )


def remove(group: int, *hashes: bytes) -> dict[str, Any]:
    return dict(operation=REMOVE, group_id=group, block_hashes=list(hashes))


def rebuild(snap: Snapshot) -> View:
    view = View()
    view.apply(snap.events)
    return view


def test_copy_counts_and_duplicates() -> None:
    state = EngineState()
    toks = list(range(16))
    state.apply(batch(0, store(toks, 0, 4), store(toks, 0, 2)))
    assert state.copies(0, h(tuple(toks[:4]))) == 2 and state.copies(0, h(tuple(toks[:12]))) == 1
    assert state.blocks == 6
    state.apply(batch(1, remove(0, h(tuple(toks[:4]))), remove(0, h(tuple(toks[:4])))))
    assert state.copies(0, h(tuple(toks[:4]))) == 0 and state.blocks == 4
    state.apply(batch(2, remove(0, b"unknown")))
    assert state.stats.unknown_removes == 1 and state.last_sequence == 2
    view = rebuild(state.snapshot())
    expected = {h(tuple(toks[:8])): 2, h(tuple(toks[:12])): 1, h(tuple(toks[:16])): 1}
    assert view.counts == Counter({(0, bh): n for bh, n in expected.items()})


def test_snapshot_rebuilds_membership_and_positions_after_removals() -> None:
    state, live = EngineState(), View()
    a = list(range(100, 124))  # 6 blocks
    b = a[:8] + list(range(500, 516))  # shares 2 blocks
    steps = [
        batch(
            0,
            store(a, 0, 6),
            dict(
                store(a, 0, 6, group=1, kind="sliding_window", sliding_window=8),
                block_hashes=[h(tuple(a[:20])), h(tuple(a[:24]))],
            ),
        ),
        batch(1, store(b, 0, 2), store(b, 2, 6)),
        batch(2, remove(0, h(tuple(a[:24]))), remove(0, h(tuple(a[:20])))),
        batch(3, remove(0, h(tuple(a[:4])))),  # one copy of a shared block
    ]
    for step in steps:
        live.apply(state.apply(step).events)
    snap = state.snapshot(stream_id="s", reason="initial")
    assert snap.has_sequence and snap.sequence == 3 and snap.stream_id == "s"
    assert all(ev.operation == STORE for ev in snap.events)
    view = rebuild(snap)
    assert view.counts == live.counts
    for group, bh in live.counts:
        if group == 0:  # full attention holds the whole prefix of these: exact positions
            assert view.paths[bh] == live.paths[bh]
    # The sliding-window tail of `a` outlived a's full-attention blocks: membership is exact,
    # but its position is not rebuilt (documented; no hit can use it without those blocks).
    assert view.counts[(1, h(tuple(a[:24])))] == 1 and h(tuple(a[:24])) not in view.paths
    # group declarations come first and carry the group's metadata
    assert (snap.events[1].group_id, snap.events[1].kind, snap.events[1].sliding_window) == (
        1,
        "sliding_window",
        8,
    )
    assert not snap.events[0].block_hashes


def test_clear_keeps_groups_and_invalid_forgets_them() -> None:
    state = EngineState()
    state.apply(
        batch(
            0,
            store(list(range(8)), 0, 2),
            dict(operation=STORE, group_id=3, kind="mamba", block_size=BS),
        )
    )
    state.apply(batch(1, dict(operation=CLEAR)))
    assert state.blocks == 0 and set(state.groups) == {0, 3}
    snap = state.snapshot()
    assert [(e.group_id, len(e.block_hashes)) for e in snap.events] == [(0, 0), (3, 0)]
    state.apply(batch(2, dict(operation=INVALID)))
    assert state.groups == {} and state.stats.invalid_resets == 1 and state.last_sequence == 2


def test_group_kind_change_inserts_invalid_for_everyone() -> None:
    state = EngineState()
    state.apply(batch(0, store(list(range(8)), 0, 2)))
    changed = batch(1, store(list(range(50, 58)), 0, 2, kind="sliding_window", sliding_window=8))
    out = state.apply(changed)
    assert [e.operation for e in out.events] == [INVALID, STORE] and out.sequence == 1
    assert state.groups == {0: ("sliding_window", 8, BS)} and state.blocks == 2
    # an unknown kind ("" before vLLM 0.22) is not a change
    same = state.apply(batch(2, store(list(range(60, 68)), 0, 1, kind="")))
    assert [e.operation for e in same.events] == [STORE]


def test_group_bound() -> None:
    state = EngineState(max_groups=2)
    out = state.apply(
        batch(0, *(dict(operation=STORE, group_id=g, block_size=BS) for g in range(3)))
    )
    assert [e.operation for e in out.events] == [STORE, STORE, INVALID, STORE]
    assert set(state.groups) == {2}


def test_decode_chain_is_one_record_and_snapshot_stays_dense() -> None:
    state, live = EngineState(), View()
    toks = list(range(70000, 70000 + 4 * BS))  # token ids above 65535: 32-bit storage
    for i in range(4):
        live.apply(state.apply(batch(i, store(toks, i, i + 1))).events)
    assert state.records == 1
    snap = state.snapshot()
    (ev,) = snap.events[1:]
    assert len(ev.block_hashes) == 4 and list(ev.token_ids) == toks and ev.parent_block_hash == b""
    assert rebuild(snap).paths == live.paths


def test_cache_salt_and_namespace_survive_snapshot() -> None:
    state = EngineState()
    toks = list(range(8))
    state.apply(
        batch(
            0, store(toks, 0, 1, cache_salt="s", lora_name="ad"), store(toks, 1, 2, lora_name="ad")
        )
    )
    # the child was appended to its parent's record: one dense store, salted at token 0
    (event,) = state.snapshot().events[1:]
    assert (event.cache_salt, event.lora_name, len(event.block_hashes)) == ("s", "ad", 2)
    # a salted run that loses its first block is emitted without the salt
    state.apply(batch(1, remove(0, h(tuple(toks[:4])))))
    (rest,) = state.snapshot().events[1:]
    assert rest.cache_salt == "" and rest.parent_block_hash == h(tuple(toks[:4]))


def test_max_blocks_bound_evicts_oldest_and_counts() -> None:
    state, live = EngineState(max_blocks=10), View()
    for i in range(6):
        toks = list(range(i * 1000, i * 1000 + 3 * BS))
        live.apply(state.apply(batch(i, store(toks, 0, 3))).events)
    assert state.blocks <= 10 and state.stats.evicted_blocks == 18 - state.blocks
    view = rebuild(state.snapshot())
    # what a late subscriber sees is a subset of the engine's cache, never more
    assert all(live.counts[key] >= count for key, count in view.counts.items())
    assert sum(view.counts.values()) == state.blocks
    # removes of evicted blocks are harmless
    state.apply(batch(7, remove(0, h(tuple(range(3 * BS))))))


def test_parents_first_when_parent_is_restored_later() -> None:
    state = EngineState()
    toks = list(range(200, 200 + 4 * BS))
    state.apply(batch(0, store(toks, 0, 2)))
    state.apply(batch(1, store(toks, 2, 4)))
    state.apply(batch(2, remove(0, *[h(tuple(toks[: (i + 1) * BS])) for i in range(2)])))
    state.apply(batch(3, store(toks, 0, 2)))  # the prefix comes back after its children
    events = state.snapshot().events[1:]
    assert events[0].parent_block_hash == b"" and events[1].parent_block_hash == h(tuple(toks[:8]))
    live = View()
    live.apply(events)
    assert not live.pending and len(live.paths) == 4


# Property: for random engine-like histories, snapshot counts equal the live view's, and
# positions agree for every block whose whole prefix is cached in the full-attention group.
_op = st.one_of(
    st.tuples(
        st.just("store"), st.integers(0, 5), st.integers(0, 6), st.integers(1, 6), st.booleans()
    ),
    st.tuples(st.just("remove"), st.integers(0, 10_000)),
    st.tuples(st.just("clear")),
)


@settings(max_examples=int(os.environ.get("KVROUTE_FUZZ_EXAMPLES", "200")), deadline=None)
@given(st.lists(_op, max_size=40), st.integers(8, 200))
def test_snapshot_equals_live_view(ops: list[tuple[Any, ...]], max_blocks: int) -> None:
    prompts = [[p % 3] * 4 + [p * 100 + i for i in range(24)] for p in range(6)]
    state, live = EngineState(max_blocks=max_blocks), View()
    for seq, op in enumerate(ops):
        if op[0] == "store":
            _, p, start, length, sparse = op
            toks = prompts[p]
            stop = min(start + length, 7)
            if start >= stop:
                continue
            events = [store(toks, start, stop)]
            if sparse:
                tail = events[0]["block_hashes"][-2:]
                events.append(
                    dict(
                        events[0],
                        group_id=1,
                        block_hashes=tail,
                        kind="sliding_window",
                        sliding_window=8,
                    )
                )
            out = state.apply(batch(seq, *events))
        elif op[0] == "remove":
            held = sorted(live.counts)
            if not held:
                continue
            group, bh = held[op[1] % len(held)]
            out = state.apply(batch(seq, remove(group, bh)))
        else:
            out = state.apply(batch(seq, dict(operation=CLEAR)))
        live.apply(out.events)
    view = rebuild(state.snapshot())
    if state.stats.evicted_blocks == 0:
        assert view.counts == live.counts
    else:
        assert all(live.counts[key] >= count for key, count in view.counts.items())
    assert sum(view.counts.values()) == state.blocks
    fa = {bh for (g, bh) in view.counts if g == 0}
    for p in prompts:
        for i in range(7):
            chain = [h(tuple(p[: (j + 1) * BS])) for j in range(i + 1)]
            if all(c in fa for c in chain):
                assert view.paths.get(chain[-1]) == tuple(p[: (i + 1) * BS])
