"""vLLM events -> protobuf group events: hashes, filters, namespaces, every wire version."""

from __future__ import annotations

import os
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.bridge import vllm_schema as s
from kvroute.bridge.convert import ConvertStats, convert_batch, normalise_hash
from kvroute.proto.events_pb2 import KvEventBatch, KvGroupEvent, Tier
from kvroute.proto.namespace import salt_namespace

STORE, REMOVE, CLEAR, INVALID = (
    KvGroupEvent.STORE,
    KvGroupEvent.REMOVE,
    KvGroupEvent.CLEAR,
    KvGroupEvent.INVALID,
)
T64 = list(range(64))


def be(value: int) -> bytes:
    return value.to_bytes(8, "big")


def convert(events: list[s.Event], version: str = "0.33", seq: int = 7) -> KvEventBatch:
    payload = s.encode_batch(12.5, events, 1, version)
    return convert_batch(s.BatchDecoder().decode(payload), seq)


def test_batch_metadata_verbatim() -> None:
    batch = convert([s.AllBlocksCleared()], seq=2**63 + 5)
    assert batch.sequence == 2**63 + 5 and batch.timestamp == 12.5 and batch.dp_rank == 1
    assert [e.operation for e in batch.events] == [CLEAR]
    overridden = convert_batch(
        s.BatchDecoder().decode(s.encode_batch(1, [], 1, "0.33")), 0, dp_rank=4
    )
    assert overridden.dp_rank == 4


@pytest.mark.parametrize(
    "raw,expected",
    [
        (0, be(0)),
        (2**64 - 1, b"\xff" * 8),
        (-1, b"\xff" * 8),
        (-(2**63), be(2**63)),
        (2**70 + 3, be(3)),
        (b"\x01" * 32, b"\x01" * 32),
        (b"\x02" * 16, b"\x02" * 16),
        (True, None),
        (b"", None),
        (1.5, None),
        ("h", None),
        (None, None),
    ],
)
def test_normalise_hash(raw: Any, expected: bytes | None) -> None:
    assert normalise_hash(raw) == expected


def test_negative_and_bytes_hashes_on_the_wire() -> None:
    # vLLM never sends negative ints, but other producers may: two's complement 64-bit.
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [-2, b"\x07" * 32], "medium": "GPU"}], 0]
    )
    batch = convert_batch(s.BatchDecoder().decode(payload), 0)
    assert list(batch.events[0].block_hashes) == [b"\xff" * 7 + b"\xfe", b"\x07" * 32]


@pytest.mark.parametrize("bad", [True, b"", 2.5, "x", [1]])
def test_bad_hash_makes_event_invalid_and_keeps_the_rest(bad: Any) -> None:
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                {"type": "BlockRemoved", "block_hashes": [1, bad], "medium": "GPU", "group_idx": 2},
                {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"},
            ],
            0,
        ]
    )
    stats = ConvertStats()
    batch = convert_batch(s.BatchDecoder().decode(payload), 0, stats=stats)
    assert [(e.operation, e.group_id) for e in batch.events] == [(INVALID, 2), (REMOVE, 0)]
    assert stats.invalid == 1


def test_bad_parent_and_out_of_range_values_are_invalid() -> None:
    bad_parent = s.BlockStored([1], True, T64[:16], 16)
    bad_token = s.BlockStored([1], None, [2**33] * 16, 16)
    bad_block_size = s.BlockStored([1], None, T64[:16], 0)
    bad_group = s.BlockStored([1], None, T64[:16], 16, group_idx=-1)
    good = s.BlockStored([1], None, T64[:16], 16)
    stats = ConvertStats()
    payload = s.encode_batch(1, [bad_parent, bad_token, bad_block_size, bad_group, good], 0, "0.33")
    batch = convert_batch(s.BatchDecoder().decode(payload), 0, stats=stats)
    assert [e.operation for e in batch.events] == [INVALID] * 4 + [STORE]
    assert stats.invalid == 4 and stats.stored_blocks == 1


def test_local_events_kept_by_tier_and_remote_dropped_symmetrically() -> None:
    def st_(**kw: Any) -> s.BlockStored:
        return s.BlockStored([1], None, T64[:16], 16, **kw)

    def rm(**kw: Any) -> s.BlockRemoved:
        return s.BlockRemoved([1], **kw)

    gpu = [
        st_(),
        st_(medium=None),
        st_(locality="LOCAL"),
        rm(),
        rm(medium=None),
        rm(locality="LOCAL"),
    ]
    lower = [
        st_(medium="CPU"),
        st_(medium="STORAGE", locality="LOCAL"),
        st_(medium="STORAGE", ownership="tier1"),
        rm(medium="CPU"),
        rm(medium="STORAGE", ownership="tier1"),
    ]
    dropped = [
        st_(locality="REMOTE"),
        st_(ownership="tier1"),
        st_(medium="CPU", locality="REMOTE"),
        st_(medium="NVME"),
        rm(locality="REMOTE"),
        rm(ownership="tier1"),
        rm(medium="CPU", locality="REMOTE"),
    ]
    stats = ConvertStats()
    payload = s.encode_batch(1, gpu + lower + dropped, 0, "0.33")
    batch = convert_batch(s.BatchDecoder().decode(payload), 0, stats=stats)
    assert [e.operation for e in batch.events] == [STORE] * 3 + [REMOVE] * 3
    assert all(e.tier == Tier.GPU for e in batch.events)
    assert [(e.operation, e.tier) for e in batch.tier_events] == [
        (STORE, Tier.CPU),
        (STORE, Tier.STORAGE),
        (STORE, Tier.STORAGE),
        (REMOVE, Tier.CPU),
        (REMOVE, Tier.STORAGE),
    ]
    assert list(batch.tier_events[0].token_ids) == T64[:16]
    assert stats.filtered == len(dropped)


def test_lower_tier_placeholders_dropped_and_counted_but_their_removals_pass() -> None:
    placeholder = s.BlockStored([9], None, [], 0, medium="CPU", group_idx=0)
    invalid = s.BlockStored([9], None, T64[:16], 0, medium="CPU", group_idx=0)
    removal = s.BlockRemoved([9], medium="CPU", group_idx=0)
    stats = ConvertStats()
    payload = s.encode_batch(1, [placeholder, invalid, removal], 0, "0.33")
    batch = convert_batch(s.BatchDecoder().decode(payload), 0, stats=stats)
    assert not batch.events
    assert [(e.operation, e.tier) for e in batch.tier_events] == [
        (INVALID, Tier.CPU),
        (REMOVE, Tier.CPU),
    ]
    assert stats.placeholders == {Tier.CPU: 1} and stats.invalid == 1


def test_sparse_store_forwarded_whole_and_duplicates_kept() -> None:
    sparse = s.BlockStored(
        [4, 5],
        None,
        T64[:96] if len(T64) >= 96 else list(range(96)),
        16,
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=32,
    )
    dup = s.BlockStored(
        [4, 5],
        None,
        list(range(96)),
        16,
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=32,
    )
    batch = convert([sparse, dup])
    assert len(batch.events) == 2
    for event in batch.events:
        assert event.operation == STORE and event.group_id == 1
        assert list(event.block_hashes) == [be(4), be(5)]
        assert list(event.token_ids) == list(range(96))
        assert event.kind == "sliding_window" and event.sliding_window == 32
        assert event.parent_block_hash == b"" and not event.unmatchable


def test_pre_020_events_land_in_group_zero_with_empty_kind() -> None:
    for version in ("0.10", "0.11", "0.16"):
        batch = convert([s.BlockStored([1, 2], 9, T64[:32], 16), s.BlockRemoved([1])], version)
        stored, removed = batch.events
        assert (stored.group_id, stored.kind, stored.sliding_window) == (0, "", 0)
        assert stored.parent_block_hash == be(9) and list(stored.block_hashes) == [be(1), be(2)]
        assert (removed.operation, removed.group_id) == (REMOVE, 0)


def test_lora_name_and_cache_salt() -> None:
    ev = s.BlockStored(
        [1, 2], None, T64[:32], 16, lora_id=3, lora_name="ad", extra_keys=[("ad", "salty"), ("ad",)]
    )
    (event,) = convert([ev]).events
    assert (event.lora_name, event.cache_namespace, event.unmatchable) == (
        "ad",
        salt_namespace("salty"),
        False,
    )
    child = s.BlockStored([3], 2, T64[:16], 16, lora_name="ad", extra_keys=[("ad",)])
    (event,) = convert([child]).events
    assert (event.lora_name, event.cache_namespace, event.unmatchable) == ("ad", "", False)


def test_salt_only_recognised_on_the_block_at_token_zero() -> None:
    # A bare string on a later block is not something vLLM publishes: do not guess.
    ev = s.BlockStored([3], 2, T64[:16], 16, extra_keys=[("salty",)])
    (event,) = convert([ev]).events
    assert event.unmatchable and event.cache_namespace == ""


def test_lora_known_only_by_id_is_unmatchable() -> None:
    (event,) = convert([s.BlockStored([1], None, T64[:16], 16, lora_id=2)], "0.11").events
    assert event.unmatchable


def test_dense_store_split_at_first_multimodal_block() -> None:
    ev = s.BlockStored(
        [1, 2, 3, 4], None, T64, 16, extra_keys=[("salt",), None, (("img", 0),), None]
    )
    stats = ConvertStats()
    payload = s.encode_batch(1, [ev], 0, "0.33")
    first, second = convert_batch(s.BatchDecoder().decode(payload), 0, stats=stats).events
    assert list(first.block_hashes) == [be(1), be(2)] and list(first.token_ids) == T64[:32]
    assert first.cache_namespace == salt_namespace("salt") and not first.unmatchable
    assert list(second.block_hashes) == [be(3), be(4)] and list(second.token_ids) == T64[32:]
    assert second.parent_block_hash == be(2) and second.unmatchable and second.cache_namespace == ""
    assert stats.split == 1 and stats.stored_blocks == 4


def test_sparse_store_with_multimodal_keys_is_unmatchable_whole() -> None:
    ev = s.BlockStored([4, 5], None, list(range(96)), 16, extra_keys=[None, (("img", 3),)])
    (event,) = convert([ev]).events
    assert event.unmatchable and list(event.block_hashes) == [be(4), be(5)]
    assert len(event.token_ids) == 96


@pytest.mark.parametrize("extra", [[(b"embeds-digest",)], [(("img", 0),)], [(7,)], [("a", "b")]])
def test_unreproducible_extra_keys_are_unmatchable(extra: list[Any]) -> None:
    (event,) = convert([s.BlockStored([1], None, T64[:16], 16, extra_keys=extra)]).events
    assert event.unmatchable


def test_extra_keys_length_mismatch_is_unmatchable() -> None:
    ev = s.BlockStored([1, 2], None, T64[:32], 16, extra_keys=[None])
    (event,) = convert([ev]).events
    assert event.unmatchable and len(event.block_hashes) == 2


def test_lookahead_tokens_make_blocks_unmatchable() -> None:
    ev = s.BlockStored([1], None, T64[:16], 16, lookahead_token_ids=[[77]])
    (event,) = convert([ev]).events
    assert event.unmatchable
    (older,) = convert([ev], "0.32").events  # field did not exist: dropped by the encoder
    assert not older.unmatchable


def test_empty_store_declares_group() -> None:
    ev = s.BlockStored([], None, [], 16, group_idx=2, kv_cache_spec_kind="mamba")
    (event,) = convert([ev]).events
    assert (event.operation, event.group_id, event.kind, len(event.block_hashes)) == (
        STORE,
        2,
        "mamba",
        0,
    )


# Golden: one hybrid step (spec §5.2's observed batch) in every wire version.
def hybrid_step() -> list[s.Event]:
    tokens = list(range(1000, 1096))
    h = [101, 102, 103, 104, 105, 106]
    common: dict[str, Any] = dict(parent_block_hash=None, token_ids=tokens, block_size=16)
    return [
        s.BlockRemoved([99], group_idx=0),
        s.BlockStored(h, group_idx=0, kv_cache_spec_kind="full_attention", **common),
        s.BlockStored(
            h[4:],
            group_idx=1,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=32,
            **common,
        ),
        s.BlockStored(h[5:], group_idx=2, kv_cache_spec_kind="mamba", **common),
        s.AllBlocksCleared(),
    ]


@pytest.mark.parametrize("version", s.KNOWN_WIRE_VERSIONS)
def test_golden_hybrid_step_every_version(version: str) -> None:
    v = s.parse_wire_version(version)
    batch = convert(hybrid_step(), version, seq=3)
    ops = [e.operation for e in batch.events]
    assert ops == [REMOVE, STORE, STORE, STORE, CLEAR]
    rm, fa, swa, mamba, _ = batch.events
    has_groups, has_kind = v >= (0, 20), v >= (0, 22)
    assert list(rm.block_hashes) == [be(99)]
    assert list(fa.block_hashes) == [be(x) for x in (101, 102, 103, 104, 105, 106)]
    assert list(swa.block_hashes) == [be(105), be(106)]
    assert list(mamba.block_hashes) == [be(106)]
    for event, group, kind, window in (
        (fa, 0, "full_attention", 0),
        (swa, 1, "sliding_window", 32),
        (mamba, 2, "mamba", 0),
    ):
        assert event.group_id == (group if has_groups else 0)
        assert event.kind == (kind if has_kind else "")
        assert event.sliding_window == (window if has_kind else 0)
        assert list(event.token_ids) == list(range(1000, 1096)) and event.block_size == 16
        assert event.parent_block_hash == b""


# Fuzzing: nothing a peer sends may crash the decoder or the converter.
@settings(max_examples=int(os.environ.get("KVROUTE_FUZZ_EXAMPLES", "300")), deadline=None)
@given(st.binary(max_size=256))
def test_fuzz_random_bytes(data: bytes) -> None:
    decoder = s.BatchDecoder()
    try:
        batch = decoder.decode(data)
    except s.MalformedPayload:
        return
    convert_batch(batch, 0)


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=4),
    st.binary(max_size=9),
    st.sampled_from(["GPU", "CPU", "LOCAL", "REMOTE", "BlockStored", "BlockRemoved"]),
)
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4), max_leaves=12)
_stored_keys = [name for name in s.DecodedStored.__struct_fields__] + ["type", "extra"]
_event_map = st.fixed_dictionaries(
    {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])},
    optional={key: _values for key in _stored_keys if key != "type"},
)
_event_array = st.tuples(
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]),
    st.lists(_values, max_size=16),
).map(lambda t: [t[0], *t[1]])
_event = st.one_of(
    _event_map,
    _event_array,
    # Well-typed stores with wrong values (bad hashes, huge tokens, negative groups).
    st.builds(
        lambda hashes, parent, tokens, size, group: {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": size,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "group_idx": group,
        },
        st.lists(_scalars, max_size=4),
        _scalars,
        st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=8),
        st.integers(min_value=-(2**40), max_value=2**40),
        st.one_of(st.none(), st.integers(min_value=-(2**40), max_value=2**40)),
    ),
)
_batch = st.one_of(
    st.tuples(_values, st.lists(_event, max_size=4), _values).map(list),
    st.fixed_dictionaries({"ts": _values, "events": st.lists(_event, max_size=4)}),
    st.lists(_values, max_size=4),
)


@settings(max_examples=int(os.environ.get("KVROUTE_FUZZ_EXAMPLES", "300")), deadline=None)
@given(_batch)
def test_fuzz_structurally_plausible_payloads(raw: Any) -> None:
    payload = msgspec.msgpack.encode(raw)
    decoder = s.BatchDecoder()
    try:
        batch = decoder.decode(payload)
    except s.MalformedPayload:
        return
    converted = convert_batch(batch, 0)
    assert len(converted.events) <= len(batch.events) * 2
    KvEventBatch.FromString(converted.SerializeToString())
