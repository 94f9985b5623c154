"""The packed bridge state against reference models.

- `CopyTable` against a dict of lists (copy order, newest withdrawn first), over keys that
  collide, repeat, grow the table and shift entries back on deletion, the key 0 and bytes.
- `EngineState` against `Model`, a small model of what it promises, over random
  store/remove/clear/invalid streams with repeated copies, 8-byte, zero and other-length
  hashes, sparse groups and all three bounds: applied batches, copy counts, records and
  counters exactly (max_blocks eviction included); the lineage bound by invariants; and each
  snapshot by its meaning to a subscriber (groups, copies, and the content key the real
  indexer gives each block), never a wrong position and every position it must give.
- With lower tiers: each tier's view against an `EngineState` fed that tier's events alone,
  and, GPU and tiers alike, the snapshot built in steps against `snapshot()` and a rank
  stream's amendment (`groups.amend`) against the state's.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.bridge.copy_table import CopyTable, Key, hash_of, hashes_of, key_of, keys_of
from kvroute.bridge.groups import LOWER_TIERS, TierGroups, amend
from kvroute.bridge.state import EngineState, SnapshotPieces
from kvroute.indexer.keys import Namespace, content_keys
from kvroute.indexer.lineage import Lineage
from kvroute.indexer.presence import DictSink
from kvroute.proto.events_pb2 import KvEventBatch, KvGroupEvent, Snapshot, SubscribeResponse, Tier

STORE, REMOVE, CLEAR, INVALID = (
    KvGroupEvent.STORE,
    KvGroupEvent.REMOVE,
    KvGroupEvent.CLEAR,
    KvGroupEvent.INVALID,
)
EXAMPLES = int(os.environ.get("KVROUTE_FUZZ_EXAMPLES", "200"))


def test_keys_round_trip() -> None:
    eight = [b"\x00" * 8, b"\x01" * 8, bytes(range(8))]
    packed = keys_of(eight)
    assert packed.typecode == "Q" and hashes_of(packed) == eight
    mixed = [b"\x01" * 8, b"abc", b"x" * 32]
    keys = keys_of(mixed)
    assert isinstance(keys, list) and isinstance(keys[0], int) and keys[1] == b"abc"
    assert hashes_of(keys) == mixed and [hash_of(key_of(x)) for x in mixed] == mixed
    # 16 bytes in two hashes of 8 is not the same as one of 7 and one of 9
    assert isinstance(keys_of([b"a" * 7, b"b" * 9]), list)
    assert keys_of([]) == []


# Keys: a few small ones (heavy repetition, collisions), multiples of table sizes, the key
# 0, bytes keys, and random 64-bit ones to make the table grow.
_key = st.one_of(
    st.integers(0, 12),
    st.integers(1, 40).map(lambda i: i * 15),
    st.integers(1, 40).map(lambda i: i * 31 + 3),
    st.sampled_from([b"", b"a", b"bb", b"x" * 32]),
    st.integers(1, 2**64 - 1),
)
_table_op = st.one_of(
    st.tuples(st.just("add"), st.lists(_key, min_size=1, max_size=40), st.integers(0, 5)),
    st.tuples(st.just("pop"), _key),
    st.tuples(st.just("discard"), _key, st.integers(0, 5)),
    st.tuples(st.just("pop_held"), st.integers(0, 10_000)),
)


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(_table_op, max_size=80))
def test_copy_table_matches_a_dict_of_lists(ops: list[tuple[Any, ...]]) -> None:
    table, model = CopyTable(), dict[Key, list[int]]()
    for op in ops:
        if op[0] == "add":
            _, keys, slot = op
            table.add(keys, slot)
            for key in keys:
                model.setdefault(key, []).append(slot)
        elif op[0] in ("pop", "pop_held"):
            if op[0] == "pop":
                key = op[1]
            elif model:
                key = sorted(model, key=repr)[op[1] % len(model)]
            else:
                continue
            held = model.get(key)
            expected = held.pop() if held else None
            if held is not None and not held:
                del model[key]
            assert table.pop(key) == expected
        else:
            _, key, slot = op
            held = model.get(key, [])
            expected_found = slot in held
            if expected_found:
                held.remove(slot)
                if not held:
                    del model[key]
            assert table.discard(key, slot) is expected_found
        assert len(table) == len(model)
        for key, slots in model.items():
            assert table.holders(key) == slots and table.count(key) == len(slots)
    for key in list(model):  # removing everything leaves an empty table
        while table.pop(key) is not None:
            pass
    assert len(table) == 0 and not table.multi and not table.other


def test_copy_table_grows_and_keeps_every_key() -> None:
    table = CopyTable()
    keys = [(i * 0x9E3779B97F4A7C15) % 2**64 or 1 for i in range(1, 5000)]
    for start in range(0, len(keys), 32):
        table.add(keys[start : start + 32], start)
    assert len(table) == len(keys)
    for start in range(0, len(keys), 32):
        assert all(table.holders(k) == [start] for k in keys[start : start + 32])
    for key in keys[::2]:  # backward-shift deletion keeps the rest reachable
        assert table.pop(key) is not None
    assert all(table.count(k) == 1 for k in keys[1::2]) and len(table) == len(keys) // 2
    assert all(table.count(k) == 0 for k in keys[::2])


# -- EngineState against a small model of what it promises --------------------------------


@dataclass(eq=False)
class _Rec:
    """A record (kvroute.bridge.state): one STORE, or a dense chain of STOREs appended to it."""

    meta: tuple[Any, ...]  # (group, block size, kind, window, lora, unmatchable)
    hashes: list[bytes]
    dense: bool
    # The live records holding its anchor (its parent; a sparse record's last hash) when it
    # came: the state keeps one of them as its lineage. Anchored: the state keeps its
    # position chain down to token 0 (sure if the anchor was held and they all are).
    cands: list[_Rec]
    anchored: bool
    live: int = 0


class Model:
    """EngineState's promises with plain dicts: per group, hash -> the records holding its
    copies, oldest first (REMOVE withdraws the newest); live records, oldest first (one
    appended to moves to the end; past max_blocks the oldest go, counted); the groups; and
    each dense block's link (parent, tokens, salt), which gives its position."""

    def __init__(self, max_blocks: int, max_groups: int) -> None:
        self.max_blocks, self.max_groups = max_blocks, max_groups
        self.groups: dict[int, list[Any]] = {}  # group -> [kind, window, largest block size]
        self.last_sequence: int | None = None
        self.evicted = self.unknown = self.invalid = 0
        self._clear()

    def _clear(self, invalid: bool = False) -> None:  # INVALID: groups go too, counted
        self.invalid += invalid
        self.groups = {} if invalid else self.groups
        self.copies: dict[int, dict[bytes, list[_Rec]]] = {}
        self.records: dict[_Rec, None] = {}
        self.tails: dict[int, dict[bytes, _Rec]] = {}  # group -> last hash -> dense record
        self.links: dict[bytes, tuple[bytes, tuple[int, ...], str]] = {}
        self.spans: set[tuple[int, bytes, tuple[int, ...]]] = set()  # of sparse STOREs
        self.blocks = 0

    def apply(self, batch: KvEventBatch) -> KvEventBatch:
        out = KvEventBatch(
            sequence=batch.sequence, timestamp=batch.timestamp, dp_rank=batch.dp_rank
        )
        for ev in batch.events:
            if ev.operation == STORE:
                if not self._declare(ev):  # a contradiction: INVALID first, for everyone
                    out.events.add(operation=INVALID, group_id=ev.group_id)
                    self._clear(invalid=True)
                    self._declare(ev)
                self._store(ev)
            elif ev.operation == REMOVE:
                table = self.copies.get(ev.group_id, {})
                for x in ev.block_hashes:
                    if x in table:
                        self._withdraw(table, x, table[x][-1])  # the newest copy
                    else:
                        self.unknown += 1
            elif ev.operation == CLEAR:
                self._clear()
            else:
                self._clear(invalid=True)
            out.events.append(ev)
        self.last_sequence = batch.sequence
        return out

    def _declare(self, ev: KvGroupEvent) -> bool:  # (the test's events always name a kind)
        if ev.group_id not in self.groups and len(self.groups) >= self.max_groups:
            return False
        group = self.groups.setdefault(ev.group_id, [ev.kind, ev.sliding_window, 0])
        group[2] = max(group[2], ev.block_size)
        return group[:2] == [ev.kind, ev.sliding_window]

    def _store(self, ev: KvGroupEvent) -> None:
        hashes, parent, bs = list(ev.block_hashes), ev.parent_block_hash, ev.block_size
        group, dense = ev.group_id, len(ev.token_ids) == len(hashes) * bs
        if not hashes:
            return
        meta = (group, bs, ev.kind, ev.sliding_window, ev.lora_name, ev.unmatchable)
        tails = self.tails.setdefault(group, {})
        rec = tails.get(parent) if dense and parent and not ev.cache_namespace else None
        if rec is not None and rec.meta == meta:  # appended to the record ending at parent
            del tails[parent], self.records[rec]
            rec.hashes += hashes
        else:
            anchor = parent if dense else hashes[-1]  # b"": it starts at token 0
            cands = [r for r in self.records if anchor in r.hashes]
            held = any(anchor in table for table in self.copies.values())
            anchored = not anchor or (held and all(r.anchored for r in cands))
            rec = _Rec(meta, hashes, dense, cands, anchored)
        self.records[rec] = None
        if dense:
            tails[hashes[-1]] = rec
            for i, x in enumerate(hashes):  # link: (parent, block tokens, salt)
                tokens = tuple(ev.token_ids[i * bs : (i + 1) * bs])
                self.links.setdefault(
                    x, (hashes[i - 1] if i else parent, tokens, ev.cache_namespace)
                )
        else:
            self.spans.add((group, parent, tuple(ev.token_ids)))
        table = self.copies.setdefault(group, {})
        for x in hashes:
            table.setdefault(x, []).append(rec)
        rec.live += len(hashes)
        self.blocks += len(hashes)
        while self.blocks > self.max_blocks:  # the oldest record goes, counted
            old = next(iter(self.records))
            for x in old.hashes:
                if old in self.copies[old.meta[0]].get(x, ()):
                    self._withdraw(self.copies[old.meta[0]], x, old)
                    self.evicted += 1

    def _withdraw(self, table: dict[bytes, list[_Rec]], x: bytes, rec: _Rec) -> None:
        table[x].remove(rec)
        if not table[x]:
            del table[x]
        self.blocks -= 1
        rec.live -= 1
        if rec.live == 0:
            del self.records[rec]
            if rec.dense and self.tails[rec.meta[0]].get(rec.hashes[-1]) is rec:
                del self.tails[rec.meta[0]][rec.hashes[-1]]

    # -- the model's view ------------------------------------------------------------------

    def counts(self) -> Counter[tuple[int, bytes]]:
        return Counter({(g, x): len(rs) for g, t in self.copies.items() for x, rs in t.items()})

    def chain(self, x: bytes) -> list[bytes]:
        """x and its ancestors as far as links go: ending in b"" when they reach token 0."""
        out = [x]
        while out[-1] in self.links:
            out.append(self.links[out[-1]][0])
        return out

    def key(self, x: bytes) -> int | None:
        """x's content key (kvroute.indexer.keys), or None if its links do not reach token 0."""
        *chain, root = self.chain(x)
        if root:
            return None
        tokens = [t for h in reversed(chain) for t in self.links[h][1]]
        salt = next((self.links[h][2] for h in chain if self.links[h][2]), "")
        return content_keys(tokens, Namespace(cache_salt=salt), BS)[-1]

    def lineage_bound(self) -> int:
        """The most lineage the state may keep: blocks of dropped records reachable from a
        live one through `cands`."""
        seen: set[_Rec] = set()
        todo = list(self.records)
        while todo:
            if (r := todo.pop()) not in seen:
                seen.add(r)
                todo += r.cands
        return sum(len(r.hashes) for r in seen if r not in self.records)

    def must_place(self, lineage_intact: bool) -> set[bytes]:
        """Held blocks a snapshot must place: those whose chain to token 0 dense records
        hold (events alone place them) and, while no lineage was dropped, those an anchored
        record holds whose chain no unanchored dense record holds (lineage places them)."""
        holders = [(x, r) for t in self.copies.values() for x, rs in t.items() for r in rs]
        dense = {x for x, r in holders if r.dense}
        loose = {x for x, r in holders if r.dense and not r.anchored}
        out = {x for x in dense if set(self.chain(x)) <= dense | {b""}}
        if lineage_intact:
            out |= {x for x, r in holders if r.anchored and not loose & set(self.chain(x))}
        return out


def meaning(snap: Snapshot) -> tuple[dict[int, Any], Counter[tuple[int, bytes]], dict[bytes, int]]:
    """What a subscriber learns from a snapshot: the groups declared, copies by (group,
    hash), and the content key (position and namespace) the real indexer gives each block."""
    n = sum(1 for _ in itertools.takewhile(lambda e: not e.block_hashes, snap.events))
    declared = {e.group_id: (e.kind, e.sliding_window, e.block_size) for e in snap.events[:n]}
    assert all(e.operation == STORE and e.block_hashes for e in snap.events[n:])
    dense = [
        e
        for e in snap.events
        if e.block_hashes and len(e.token_ids) == len(e.block_hashes) * e.block_size
    ]
    all_dense = {x for e in dense for x in e.block_hashes}
    placed: set[bytes] = set()
    for e in dense:  # parents before children
        assert e.parent_block_hash not in all_dense or e.parent_block_hash in placed
        placed.update(e.block_hashes)
    assert all(len(e.token_ids) == len(e.block_hashes) * e.block_size for e in snap.lineage)
    counts = Counter((e.group_id, x) for e in snap.events for x in e.block_hashes)
    view = Lineage(DictSink(), BS, 10**6, 10**6)
    view.apply_batch(snap.events, lineage=snap.lineage)
    assert (view.conflicts, view.malformed, view.pending_evicted) == (0, 0, 0)
    keys = {x: k for _, x in counts if (k := view.content_key(x)) is not None}
    return declared, counts, keys


def check_snapshot(state: EngineState, model: Model, reason: str) -> None:
    snap = state.snapshot(stream_id="s", reason=reason)
    assert (snap.dp_rank, snap.stream_id, snap.reason) == (0, "s", reason)
    seq = model.last_sequence
    assert (snap.has_sequence, snap.sequence) == (seq is not None, seq or 0)
    declared, counts, keys = meaning(snap)
    assert declared == {g: tuple(v) for g, v in model.groups.items()} == state.groups
    assert counts == model.counts()
    for e in snap.events:  # a sparse record's span is its STORE's (or none: never dense)
        span = (e.group_id, e.parent_block_hash, tuple(e.token_ids))
        if e.block_hashes and len(e.token_ids) != len(e.block_hashes) * e.block_size:
            assert not e.token_ids or span in model.spans
    assert all(key == model.key(x) for x, key in keys.items())  # never a wrong position
    assert model.must_place(state.stats.evicted_lineage_blocks == 0) <= keys.keys()
    # Re-applied to a fresh state, the snapshot's events snapshot to the same copies, and
    # to the same positions unless some came from lineage (which it cannot re-apply).
    again = EngineState()
    again.apply(KvEventBatch(sequence=seq or 0, events=snap.events))
    declared2, counts2, keys2 = meaning(again.snapshot())
    assert (declared2, counts2) == (declared, counts) and keys2.items() <= keys.items()
    assert keys2 == keys or snap.lineage
    check_steps(state, snap, reason)
    check_steps(state, snap, reason)


def check_steps(state: EngineState, snap: Snapshot, reason: str) -> None:
    """Built in steps of one block, in serialized pieces: the same message as `snap` once
    concatenated behind a head giving the reason, tiers included."""
    pieces = SnapshotPieces()
    steps = sum(1 for _ in state.snapshot_steps(pieces, stream_id="s", step_blocks=1))
    blocks = state.blocks + sum(view.blocks for view in state.tiers.values())
    assert steps >= blocks and len(pieces.pieces) >= min(1, blocks)
    head = SubscribeResponse(snapshot=Snapshot(reason=reason)).SerializeToString()
    whole = SubscribeResponse.FromString(head + b"".join(pieces.pieces))
    assert whole.WhichOneof("message") == "snapshot" and whole.snapshot == snap
    parts = (snap.events, snap.lineage, snap.tier_events, snap.tier_lineage)
    assert pieces.events == sum(len(part) for part in parts)


BS = 2
_WIDTHS = (8, 8, 8, 16, 4)  # hash lengths by prompt: mostly vLLM's 8 bytes, some others


def _h(prompt: int, tokens: tuple[int, ...], salt: str) -> bytes:
    width = _WIDTHS[prompt % len(_WIDTHS)]
    if prompt == 3 and len(tokens) // BS % 2:
        width = 8  # prompt 3 mixes 8- and 16-byte hashes within a record
    if prompt == 0 and len(tokens) == BS and not salt:
        return bytes(8)  # a hash of 0: kept apart from the packed table
    value = hash((prompt % 2, salt, tokens)) & (2**64 - 1)  # the salt is in vLLM's hash too
    return (value.to_bytes(8, "big") * 2)[:width]


_store_op = st.tuples(
    st.just("store"),
    st.integers(0, 5),  # prompt
    st.integers(0, 5),  # first block
    st.integers(1, 4),  # blocks
    st.sampled_from(["dense", "swa", "mamba", "both", "sparse", "swa_only", "swa_only"]),
    st.integers(0, 3).map(lambda n: n == 0),  # also a second copy in the same batch
    st.sampled_from(["", "", "salt"]),
)
_remove_op = st.tuples(st.just("remove"), st.integers(0, 10_000), st.integers(1, 4))
_state_op = st.one_of(
    *[_store_op] * 6,
    *[_remove_op] * 4,
    st.tuples(st.just("remove_unknown"), st.integers(0, 3)),
    st.sampled_from([("clear",), ("invalid",), ("kind_change",), ("drain",)]),
)


def _stores(op: tuple[Any, ...], prompts: list[list[int]]) -> list[dict[str, Any]]:
    _, p, start, length, layout, twice, salt = op
    toks = prompts[p]
    stop = min(start + length, len(toks) // BS)
    if start >= stop:
        return []
    hashes = [_h(p, tuple(toks[: (i + 1) * BS]), salt) for i in range(start, stop)]
    dense = dict(
        operation=STORE,
        group_id=0,
        block_hashes=hashes,
        parent_block_hash=_h(p, tuple(toks[: start * BS]), salt) if start else b"",
        token_ids=toks[start * BS : stop * BS],
        block_size=BS,
        kind="full_attention",
        cache_namespace=salt if start == 0 else "",
    )
    events = []
    if layout == "swa_only":  # no full attention: evicted ancestors must be kept as lineage
        events.append(dict(dense, group_id=3, kind="sliding_window", sliding_window=2 * BS))
    elif layout != "sparse":
        events.append(dense)
    if layout in ("swa", "both"):
        events.append(
            dict(dense, group_id=1, kind="sliding_window", sliding_window=2 * BS)
            if layout == "swa"
            else dict(
                dense,
                group_id=1,
                kind="sliding_window",
                sliding_window=2 * BS,
                block_hashes=hashes[-2:],
            )
        )
    if layout in ("mamba", "both", "sparse"):
        events.append(dict(dense, group_id=2, kind="mamba", block_hashes=hashes[-1:]))
    if twice:
        events.append(dict(events[0]))
    return events


def _batch(seq: int, events: list[dict[str, Any]]) -> KvEventBatch:
    out = KvEventBatch(sequence=seq, timestamp=1.0)
    for ev in events:
        out.events.add(**ev)
    return out


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    st.lists(_state_op, min_size=20, max_size=80),
    st.sampled_from([4, 9, 30, 10**6]),
    st.sampled_from([1, 5, 10**6]),
    st.sampled_from([3, 64, 64]),
)
def test_engine_state_matches_the_model(
    ops: list[tuple[Any, ...]], max_blocks: int, max_lineage: int, max_groups: int
) -> None:
    shared = list(range(900, 900 + 3 * BS))
    prompts = [shared[: (p % 3) * BS] + [70_000 * (p % 2) + p * 100 + i for i in range(12)]
               for p in range(6)]  # fmt: skip
    state = EngineState(
        max_blocks=max_blocks, max_lineage_blocks=max_lineage, max_groups=max_groups
    )
    model = Model(max_blocks, max_groups)
    groups = TierGroups(max_groups)
    held: Counter[tuple[int, bytes]] = Counter()  # what was stored, evicted or not
    lineage_evicted = 0
    for seq, op in enumerate(ops):
        if op[0] == "store":
            events = _stores(op, prompts)
        elif op[0] == "remove":
            keys = sorted(k for k, n in held.items() if n)
            if not keys:
                continue
            picked = [keys[(op[1] + 5 * i) % len(keys)] for i in range(op[2])]
            events = [dict(operation=REMOVE, group_id=g, block_hashes=[x]) for g, x in picked]
        elif op[0] == "remove_unknown":
            events = [dict(operation=REMOVE, group_id=op[1], block_hashes=[b"nope", bytes(8)])]
        elif op[0] == "drain":  # every copy removed, one by one: no record and no lineage left
            events = [
                dict(operation=REMOVE, group_id=g, block_hashes=[x] * n)
                for (g, x), n in held.items()
            ]
        elif op[0] == "clear":
            events = [dict(operation=CLEAR)]
        elif op[0] == "invalid":
            events = [dict(operation=INVALID)]
        else:  # group 1 changes kind: INVALID for everyone
            events = [dict(operation=STORE, group_id=1, kind="mamba", block_size=BS)]
        batch = _batch(seq, events)
        got = state.apply(batch)
        assert got == model.apply(batch)
        assert amend(groups, batch) == got  # what a rank stream sends ahead of the state
        for ev in got.events:
            if ev.operation == STORE:
                held.update((ev.group_id, x) for x in ev.block_hashes)
            elif ev.operation == REMOVE:
                for x in ev.block_hashes:
                    if held[(ev.group_id, x)] > 0:
                        held[(ev.group_id, x)] -= 1
            else:
                held.clear()
        s = state.stats
        assert (state.blocks, state.records, state.groups, state.last_sequence) == (
            model.blocks,
            len(model.records),
            {g: tuple(v) for g, v in model.groups.items()},
            model.last_sequence,
        )
        assert (s.evicted_blocks, s.unknown_removes, s.invalid_resets) == (
            model.evicted,
            model.unknown,
            model.invalid,
        )
        counts = model.counts()
        assert counts == +held or s.evicted_blocks  # the model agrees with a plain counter
        for group, x in {*held, *counts}:
            assert state.copies(group, x) == counts[(group, x)]
        # Lineage is bounded, dropped only at the bound, and kept only while a record needs it.
        assert 0 <= state.lineage_blocks <= min(max_lineage, model.lineage_bound())
        assert s.evicted_lineage_blocks >= lineage_evicted
        assert s.evicted_lineage_blocks == 0 or max_lineage < 10**6
        lineage_evicted = s.evicted_lineage_blocks
        check_snapshot(state, model, "")
    check_snapshot(state, model, "r")


# -- lower tiers: stepped snapshot and amendment, against per-tier reference states ------

UNKNOWN_TIER: Any = 7  # a tier this bridge does not know: passed through, never kept
_TIERS = (Tier.GPU, Tier.CPU, Tier.CPU, Tier.STORAGE, UNKNOWN_TIER)


def _untiered(events: Any) -> list[KvGroupEvent]:
    out = []
    for event in events:
        copy = KvGroupEvent()
        copy.CopyFrom(event)
        copy.tier = Tier.GPU
        out.append(copy)
    return out


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(_state_op, st.sampled_from(_TIERS)), min_size=1, max_size=3),
        min_size=10,
        max_size=40,
    ),
    st.sampled_from([4, 30, 10**6]),
    st.sampled_from([3, 64]),
)
def test_tiers_stepped_snapshot_and_amendment_match_the_state(
    batches: list[list[tuple[tuple[Any, ...], Any]]], max_blocks: int, max_groups: int
) -> None:
    prompts = [[p * 100 + i for i in range(12)] for p in range(6)]
    bounds = dict(max_blocks=max_blocks, max_groups=max_groups)
    state = EngineState(**bounds)
    groups = TierGroups(max_groups)
    refs = {tier: EngineState(**bounds) for tier in LOWER_TIERS}  # one tier's events alone
    stored: list[tuple[int, bytes]] = []
    for seq, parts in enumerate(batches):
        batch = KvEventBatch(sequence=seq)
        for op, tier in parts:
            if op[0] == "store":
                events = _stores(op, prompts)
            elif op[0] in ("remove", "drain"):
                picked = stored[op[1] % len(stored) :][:2] if stored and len(op) > 1 else stored
                events = [dict(operation=REMOVE, group_id=g, block_hashes=[x]) for g, x in picked]
            elif op[0] == "remove_unknown":
                events = [dict(operation=REMOVE, group_id=op[1], block_hashes=[b"nope"])]
            elif op[0] in ("clear", "invalid"):
                events = [dict(operation=CLEAR if op[0] == "clear" else INVALID)]
            else:  # group 1 changes kind: an INVALID in this tier only
                events = [dict(operation=STORE, group_id=1, kind="mamba", block_size=BS)]
            target = batch.events if tier == Tier.GPU else batch.tier_events
            for event in events:
                target.add(**event, tier=tier)
                stored.extend((event["group_id"], x) for x in event.get("block_hashes", ()))
        sent = amend(groups, batch)  # a rank stream amends before the state applies
        got = state.apply(batch)
        assert sent == got
        assert [e.tier for e in got.events] == [Tier.GPU] * len(got.events)
        for tier, ref in refs.items():
            if any(e.operation == CLEAR for e in batch.events):
                ref.apply(KvEventBatch(sequence=seq, events=[KvGroupEvent(operation=CLEAR)]))
            mine = [e for e in batch.tier_events if e.tier == tier]
            expected = ref.apply(KvEventBatch(sequence=seq, events=_untiered(mine)))
            # The tier's amended events are the reference's, marked with the tier.
            assert _untiered(e for e in got.tier_events if e.tier == tier) == list(expected.events)
            view = state.tier(tier)
            assert (view.blocks if view else 0) == ref.blocks
        others = [e for e in got.tier_events if e.tier not in LOWER_TIERS]
        assert others == [e for e in batch.tier_events if e.tier not in LOWER_TIERS]
        snap = state.snapshot(stream_id="s", reason="initial")
        for tier, ref in refs.items():
            want = ref.snapshot()
            assert _untiered(e for e in snap.tier_events if e.tier == tier) == list(want.events)
            assert _untiered(e for e in snap.tier_lineage if e.tier == tier) == list(want.lineage)
        assert {e.tier for e in [*snap.tier_events, *snap.tier_lineage]} <= set(LOWER_TIERS)
        check_steps(state, snap, "initial")
