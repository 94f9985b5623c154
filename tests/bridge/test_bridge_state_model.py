"""The packed bridge state against reference models.

- `CopyTable` against a dict of lists (copy order, newest withdrawn first), over keys that
  collide, repeat, grow the table and shift entries back on deletion, the key 0 and bytes.
- `EngineState` against the previous dict-based implementation (dict_state_reference.py)
  and a plain copy counter, over random store/remove/clear/invalid streams with repeated
  copies, 8-byte, zero and other-length hashes, sparse groups and all three bounds: every
  applied batch, counter and snapshot must be identical.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from dict_state_reference import EngineState as ReferenceState
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.copy_table import CopyTable, Key, hash_of, hashes_of, key_of, keys_of
from bridge.state import EngineState
from proto.events_pb2 import KvEventBatch, KvGroupEvent

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


# -- EngineState against the previous implementation ----------------------------------------

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
    st.sampled_from([("clear",), ("invalid",), ("kind_change",)]),
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
        cache_salt=salt if start == 0 else "",
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


def _counters(state: Any) -> tuple[Any, ...]:
    s = state.stats
    return (
        state.blocks,
        state.lineage_blocks,
        state.records,
        state.groups,
        state.last_sequence,
        (s.evicted_blocks, s.evicted_lineage_blocks, s.unknown_removes, s.invalid_resets),
    )


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    st.lists(_state_op, min_size=20, max_size=80),
    st.sampled_from([4, 9, 30, 10**6]),
    st.sampled_from([1, 5, 10**6]),
    st.sampled_from([3, 64, 64]),
)
def test_engine_state_matches_the_dict_reference(
    ops: list[tuple[Any, ...]], max_blocks: int, max_lineage: int, max_groups: int
) -> None:
    shared = list(range(900, 900 + 3 * BS))
    prompts = [shared[: (p % 3) * BS] + [70_000 * (p % 2) + p * 100 + i for i in range(12)]
               for p in range(6)]  # fmt: skip
    bounds = dict(max_blocks=max_blocks, max_lineage_blocks=max_lineage, max_groups=max_groups)
    state, ref = EngineState(**bounds), ReferenceState(**bounds)  # type: ignore[arg-type]
    held: Counter[tuple[int, bytes]] = Counter()  # the plain model: copies by (group, hash)
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
        elif op[0] == "clear":
            events = [dict(operation=CLEAR)]
        elif op[0] == "invalid":
            events = [dict(operation=INVALID)]
        else:  # group 1 changes kind: INVALID for everyone
            events = [dict(operation=STORE, group_id=1, kind="mamba", block_size=BS)]
        batch = _batch(seq, events)
        got, expected = state.apply(batch), ref.apply(batch)
        assert got == expected
        for ev in got.events:
            if ev.operation == STORE:
                held.update((ev.group_id, x) for x in ev.block_hashes)
            elif ev.operation == REMOVE:
                for x in ev.block_hashes:
                    if held[(ev.group_id, x)] > 0:
                        held[(ev.group_id, x)] -= 1
            else:
                held.clear()
        assert _counters(state) == _counters(ref)
        for group, x in held:
            assert state.copies(group, x) == ref.copies(group, x)
            if state.stats.evicted_blocks == 0:
                assert state.copies(group, x) == held[(group, x)]
        if seq % 7 == 0:
            assert state.snapshot(stream_id="s") == ref.snapshot(stream_id="s")
    assert state.snapshot(stream_id="s", reason="r") == ref.snapshot(stream_id="s", reason="r")
