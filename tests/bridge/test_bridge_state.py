"""The bridge's engine state: copy counts, snapshot lineage, bounds."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.bridge.state import EngineState
from kvroute.proto.events_pb2 import KvEventBatch, KvGroupEvent, Snapshot

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

    def place(self, lineage: Any) -> None:
        """A snapshot's lineage: positions from dense stores, no copies."""
        for ev in lineage:
            assert ev.operation == STORE
            assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size and ev.block_hashes
            self.pending.append(ev)
            self._resolve()

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
    view.place(snap.lineage)
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
    # The sliding-window tail of `a` outlived a's full-attention copies of it: membership is
    # exact, and the lineage (a's full-attention record, sent position-only) places it.
    assert view.counts[(1, h(tuple(a[:24])))] == 1
    assert view.paths[h(tuple(a[:24]))] == tuple(a[:24])
    assert [list(ev.block_hashes) for ev in snap.lineage] == [
        [h(tuple(a[: (i + 1) * BS])) for i in range(6)]
    ]
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
            0,
            store(toks, 0, 1, cache_namespace="s", lora_name="ad"),
            store(toks, 1, 2, lora_name="ad"),
        )
    )
    # the child was appended to its parent's record: one dense store, salted at token 0
    (event,) = state.snapshot().events[1:]
    assert (event.cache_namespace, event.lora_name, len(event.block_hashes)) == ("s", "ad", 2)
    # a salted run that loses its first block is emitted without the salt
    state.apply(batch(1, remove(0, h(tuple(toks[:4])))))
    (rest,) = state.snapshot().events[1:]
    assert rest.cache_namespace == "" and rest.parent_block_hash == h(tuple(toks[:4]))


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


# -- lineage of evicted ancestors (layouts without a full-attention group) ----------------

SWA = {"kind": "sliding_window", "sliding_window": 4 * BS}


def test_snapshot_places_a_window_tail_whose_prefix_was_evicted() -> None:
    """conformance-findings.md's minimal case: one sliding-window group; blocks [0, 2) leave
    the window and are evicted; the snapshot must still place [2, 6)."""
    state, live = EngineState(), View()
    toks = list(range(300, 300 + 6 * BS))
    live.apply(state.apply(batch(0, store(toks, 0, 6, **SWA))).events)
    first = [h(tuple(toks[: (i + 1) * BS])) for i in range(2)]
    live.apply(state.apply(batch(1, remove(0, first[0]), remove(0, first[1]))).events)
    snap = state.snapshot()
    (run,) = snap.events[1:]
    assert run.parent_block_hash == first[1] and len(run.block_hashes) == 4
    (lineage,) = snap.lineage  # the record itself, whole, position-only
    assert lineage.parent_block_hash == b"" and list(lineage.token_ids) == toks
    view = rebuild(snap)
    assert view.counts == live.counts  # lineage adds no copies
    assert all(view.paths[bh] == live.paths[bh] for _, bh in live.counts)


def _hashes(toks: list[int], start: int, stop: int) -> list[bytes]:
    return [h(tuple(toks[: (i + 1) * BS])) for i in range(start, stop)]


def test_lineage_outlives_its_copies_while_a_descendant_needs_it() -> None:
    state, live = EngineState(), View()
    a = list(range(1000, 1000 + 6 * BS))
    b = a[: 3 * BS] + list(range(2000, 2000 + 3 * BS))  # branches off a's third block
    live.apply(state.apply(batch(0, store(a, 0, 6, **SWA))).events)
    live.apply(state.apply(batch(1, store(b, 3, 6, **SWA))).events)  # its own record
    assert state.records == 2
    # a's blocks all leave the cache: its record is kept as lineage only, for b's
    live.apply(state.apply(batch(2, *(remove(0, x) for x in _hashes(a, 0, 6)))).events)
    assert state.records == 1 and state.lineage_blocks == 6 and state.blocks == 3
    snap = state.snapshot()
    assert [list(ev.block_hashes) for ev in snap.lineage] == [_hashes(a, 0, 6)]
    view = rebuild(snap)
    assert view.counts == live.counts
    assert all(view.paths[bh] == live.paths[bh] for bh in _hashes(b, 3, 6))
    # b's first block goes: its own record now places the rest, a's still places b
    live.apply(state.apply(batch(3, remove(0, _hashes(b, 3, 4)[0]))).events)
    snap = state.snapshot()
    assert [len(ev.block_hashes) for ev in snap.lineage] == [6, 3]
    assert all(rebuild(snap).paths[bh] == live.paths[bh] for bh in _hashes(b, 4, 6))
    # the last descendant goes: the lineage is released with it
    live.apply(state.apply(batch(4, *(remove(0, x) for x in _hashes(b, 4, 6)))).events)
    assert state.records == 0 and state.lineage_blocks == 0 and state.blocks == 0
    assert not state.snapshot().lineage


def test_lineage_of_a_full_attention_chain_is_not_sent_when_the_chain_places_itself() -> None:
    state = EngineState()
    a = list(range(100, 100 + 6 * BS))
    b = a[: 3 * BS] + list(range(200, 200 + 3 * BS))
    state.apply(batch(0, store(a, 0, 6)))
    state.apply(batch(1, store(b, 3, 6)))
    state.apply(batch(2, *(remove(0, x) for x in _hashes(a, 3, 6))))  # a's tail only
    snap = state.snapshot()
    assert not snap.lineage and state.lineage_blocks == 0


def test_lineage_bound_drops_the_oldest_and_counts() -> None:
    state = EngineState(max_lineage_blocks=8)
    tails = []
    for i in range(4):  # four conversations, each with a live branch off an evicted prefix
        a = list(range(10_000 * (i + 1), 10_000 * (i + 1) + 4 * BS))
        b = a[: 2 * BS] + list(range(5000 + 100 * i, 5000 + 100 * i + 2 * BS))
        state.apply(batch(3 * i, store(a, 0, 4, **SWA)))
        state.apply(batch(3 * i + 1, store(b, 2, 4, **SWA)))
        state.apply(batch(3 * i + 2, *(remove(0, x) for x in _hashes(a, 0, 4))))
        tails.append(_hashes(b, 2, 4))
    # the third conversation's lineage went over 8: the oldest went, down to 7/8 of it
    assert state.lineage_blocks == 8 and state.stats.evicted_lineage_blocks == 8
    view = rebuild(state.snapshot())
    assert sum(view.counts.values()) == state.blocks == 8  # copies are never lost to it
    placed = [all(bh in view.paths for bh in tail) for tail in tails]
    assert placed == [False, False, True, True]  # the newest lineage is kept
    # releasing a branch whose lineage was dropped is harmless; a kept one releases its own
    state.apply(batch(99, *(remove(0, x) for x in tails[0] + tails[3])))
    assert state.blocks == 4 and state.lineage_blocks == 4 and state.records == 2


# Property: a subscriber that joins from a snapshot answers exactly as one that followed the
# live stream, on layouts without full attention (sliding window, optionally with Mamba).
# Stores name a parent the engine holds (the request's last computed block), as vLLM's do.
_swa_op = st.one_of(
    st.tuples(st.just("store"), st.integers(0, 4), st.integers(0, 7), st.integers(1, 4)),
    st.tuples(st.just("remove"), st.integers(0, 10_000), st.integers(1, 3)),
)


@settings(max_examples=int(os.environ.get("KVROUTE_FUZZ_EXAMPLES", "200")), deadline=None)
@given(st.lists(_swa_op, max_size=40), st.booleans(), st.sampled_from([None, 1, 6]))
def test_snapshot_answers_like_the_live_stream_without_full_attention(
    ops: list[tuple[Any, ...]], mamba: bool, max_lineage: int | None
) -> None:
    """Exact with the default lineage bound; with a tiny one, never higher than live."""
    from kvroute.indexer import GroupCache

    shared = list(range(900, 900 + 3 * BS))
    prompts = [shared[: (p % 3) * BS] + [p * 100 + i for i in range(40)] for p in range(5)]
    prompts = [p[: 8 * BS] for p in prompts]
    state = EngineState(max_lineage_blocks=max_lineage or 10**6)
    live = GroupCache(hash_unit=BS)
    held: Counter[tuple[int, bytes]] = Counter()
    seq = -1
    for op in ops:
        seq += 1
        if op[0] == "store":
            _, p, start, length = op
            toks = prompts[p]
            stop = min(start + length, 8)
            parent = _hashes(toks, start - 1, start)[0] if start else None
            if start >= stop or (parent and not any(held[(g, parent)] for g in (0, 1))):
                seq -= 1
                continue
            events = [store(toks, start, stop, **SWA)]
            if mamba:  # a state at the store's last block: a sparse report over the span
                events.append(
                    dict(events[0], group_id=1, kind="mamba", sliding_window=0,
                         block_hashes=events[0]["block_hashes"][-1:])
                )  # fmt: skip
            out = state.apply(batch(seq, *events))
            for ev in events:
                held.update((ev["group_id"], bh) for bh in ev["block_hashes"])
        else:
            keys = sorted(k for k, n in held.items() if n)
            if not keys:
                seq -= 1
                continue
            picked = [keys[(op[1] + i * 7) % len(keys)] for i in range(op[2])]
            picked = list(dict.fromkeys(picked))
            out = state.apply(batch(seq, *(remove(g, bh) for g, bh in picked)))
            held.subtract(picked)
        live.apply(out)
    joined = GroupCache(hash_unit=BS)
    joined.apply_snapshot(state.snapshot())
    for toks in prompts:
        for n in range(1, len(toks) + 2):
            probe = [*toks, 1][:n]
            got, expected = joined.reusable_tokens(probe), live.reusable_tokens(probe)
            if max_lineage is None or state.stats.evicted_lineage_blocks == 0:
                assert got == expected, n
            else:
                assert got is not None and expected is not None and got <= expected, n


def test_lineage_metrics_follow_the_state() -> None:
    from kvroute.bridge.metrics import BridgeMetrics
    from kvroute.bridge.stream import RankStream

    metrics = BridgeMetrics()
    stream = RankStream(0, "b", EngineState(max_lineage_blocks=4), metrics)

    def sample(name: str) -> float:
        return metrics.registry.get_sample_value(name, {"dp_rank": "0"}) or 0.0

    a = list(range(7000, 7000 + 4 * BS))
    b = a[: 2 * BS] + list(range(8000, 8000 + 2 * BS))
    stream.apply(batch(0, store(a, 0, 4, **SWA)))
    stream.apply(batch(1, store(b, 2, 4, **SWA)))
    stream.apply(batch(2, *(remove(0, x) for x in _hashes(a, 0, 4))))
    assert sample("kvroute_bridge_state_lineage_blocks") == 4
    c = list(range(9000, 9000 + 4 * BS))
    d = c[: 2 * BS] + list(range(9500, 9500 + 2 * BS))
    stream.apply(batch(3, store(c, 0, 4, **SWA)))
    stream.apply(batch(4, store(d, 2, 4, **SWA)))
    stream.apply(batch(5, *(remove(0, x) for x in _hashes(c, 0, 4))))
    assert sample("kvroute_bridge_state_evicted_lineage_blocks_total") == 4
    assert sample("kvroute_bridge_state_lineage_blocks") == 4
