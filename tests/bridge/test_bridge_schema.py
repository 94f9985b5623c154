"""Golden encodings of every vLLM wire version, decoded again; frame helpers."""

from __future__ import annotations

import msgspec
import pytest

from kvroute.bridge import vllm_schema as s

TOKENS = list(range(100, 132))


def stored(**overrides: object) -> s.BlockStored:
    fields: dict[str, object] = dict(
        block_hashes=[7, 2**64 - 1],
        parent_block_hash=None,
        token_ids=TOKENS,
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[("salt",), None],
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=32,
        locality="LOCAL",
        ownership=None,
        session_id="s1",
        lookahead_token_ids=[[5], [6]],
    )
    fields.update(overrides)
    return s.BlockStored(**fields)  # type: ignore[arg-type]


# Expected payloads written from the spec's rules (§2), with generic msgpack values only:
# arrays list every field the version had; maps start with "type", keep declaration order,
# always write required fields and omit optional fields that are None.
def golden(version: str) -> bytes:
    ek = [["salt"], None]
    if version == "0.10":
        ev = [["BlockStored", [7, 2**64 - 1], None, TOKENS, 16, None], ["BlockRemoved", [9]]]
    elif version == "0.16":
        ev = [
            ["BlockStored", [7, 2**64 - 1], None, TOKENS, 16, None, "GPU", None],
            ["BlockRemoved", [9], "GPU"],
        ]
    elif version == "0.23":
        ev = [
            [
                "BlockStored",
                [7, 2**64 - 1],
                None,
                TOKENS,
                16,
                None,
                "GPU",
                None,
                ek,
                1,
                "sliding_window",
                32,
            ],
            ["BlockRemoved", [9], "GPU", 1],
        ]
    else:
        st: dict[str, object] = {
            "type": "BlockStored",
            "block_hashes": [7, 2**64 - 1],
            "parent_block_hash": None,
            "token_ids": TOKENS,
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": ek,
            "group_idx": 1,
            "kv_cache_spec_kind": "sliding_window",
            "kv_cache_spec_sliding_window": 32,
        }
        rm: dict[str, object] = {
            "type": "BlockRemoved",
            "block_hashes": [9],
            "medium": "GPU",
            "group_idx": 1,
        }
        if version in ("0.26", "0.33"):
            st["locality"] = "LOCAL"
            rm["locality"] = "LOCAL"
        if version == "0.33":
            st["session_id"] = "s1"
            st["lookahead_token_ids"] = [[5], [6]]
        ev = [st, rm]
    cleared = ["AllBlocksCleared"] if version < "0.24" else {"type": "AllBlocksCleared"}
    parts = [msgspec.msgpack.encode(event) for event in [*ev, cleared]]
    if version == "0.33":
        # msgspec sizes a struct's map header by its field count (16 keys with "type"), so
        # vLLM 0.33 writes a map16 header even when fewer keys are present.
        parts[0] = b"\xde\x00" + bytes([len(ev[0])]) + parts[0][1:]
    return b"".join(
        [b"\x93", msgspec.msgpack.encode(1.5), b"\x93", *parts, msgspec.msgpack.encode(3)]
    )


@pytest.mark.parametrize("version", ["0.10", "0.16", "0.23", "0.24", "0.26", "0.33"])
def test_encoder_matches_golden_bytes(version: str) -> None:
    events = [stored(), s.BlockRemoved([9], "GPU", 1, "LOCAL"), s.AllBlocksCleared()]
    assert s.encode_batch(1.5, events, 3, version) == golden(version)


@pytest.mark.parametrize("version", s.KNOWN_WIRE_VERSIONS)
def test_every_version_decodes(version: str) -> None:
    payload = s.encode_batch(
        2.0, [stored(), s.BlockRemoved([9], "GPU", 1), s.AllBlocksCleared()], 0, version
    )
    batch = s.BatchDecoder().decode(payload)
    assert batch.ts == 2.0 and batch.data_parallel_rank == 0
    st, rm, cl = batch.events
    assert isinstance(st, s.DecodedStored)
    assert isinstance(rm, s.DecodedRemoved)
    assert isinstance(cl, s.DecodedCleared)
    v = s.parse_wire_version(version)
    assert st.block_hashes == [7, 2**64 - 1]
    assert st.token_ids == TOKENS and st.block_size == 16 and st.parent_block_hash is None
    assert st.medium == ("GPU" if v >= (0, 11) else None)
    assert st.group_idx == (1 if v >= (0, 20) else None)
    assert rm.group_idx == (1 if v >= (0, 20) else None)
    assert st.kv_cache_spec_kind == ("sliding_window" if v >= (0, 22) else None)
    assert st.locality == ("LOCAL" if v >= (0, 26) else None)
    assert st.session_id == ("s1" if v >= (0, 30) else None)
    assert st.lookahead_token_ids == ([[5], [6]] if v >= (0, 33) else None)
    assert rm.block_hashes == [9]


def test_batch_as_map_decodes() -> None:
    for version in ("0.23", "0.33"):
        payload = s.encode_batch(1.0, [stored()], None, version, batch_as_map=True)
        assert payload[0] & 0xF0 == 0x80  # a msgpack fixmap
        batch = s.BatchDecoder().decode(payload)
        assert batch.data_parallel_rank is None
        assert batch.events[0].block_hashes == [7, 2**64 - 1]


def test_unknown_fields_ignored_and_counted() -> None:
    decoder = s.BatchDecoder()
    future_map = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "tier": 3}], 0]
    )
    future_array = msgspec.msgpack.encode(
        [1.0, [["BlockRemoved", [1], "GPU", 0, None, None, 9]], 0]
    )
    batch = decoder.decode(future_map)
    assert batch.events[0].block_hashes == [1]
    assert decoder.decode(future_array).events[0].group_idx == 0
    assert decoder.unknown_field_batches == 2
    assert "BlockRemoved.tier" in decoder.unknown_field_names
    assert any(name.startswith("BlockRemoved[") for name in decoder.unknown_field_names)
    decoder.decode(s.encode_batch(1.0, [s.BlockRemoved([1])], 0, "0.33"))
    assert decoder.unknown_field_batches == 2


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x93",
        msgspec.msgpack.encode([1.0, [{"type": "BlockEvicted", "block_hashes": [1]}], 0]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, ["x"], 16]], 0]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}], 0]),
        msgspec.msgpack.encode(["ts", [], 0]),
        msgspec.msgpack.encode({"ts": 1.0}),
    ],
)
def test_malformed_payloads_raise(payload: bytes) -> None:
    with pytest.raises(s.MalformedPayload):
        s.BatchDecoder().decode(payload)


def test_bad_hash_values_survive_decoding() -> None:
    # A bad hash is the converter's business (INVALID event), not a malformed batch.
    payload = msgspec.msgpack.encode([1.0, [["BlockRemoved", [True, b"", 1.5]]], 0])
    assert s.BatchDecoder().decode(payload).events[0].block_hashes == [True, b"", 1.5]


def test_live_frames_roundtrip() -> None:
    frames = s.live_frames("kv", 2**40, b"payload")
    assert frames[1] == (2**40).to_bytes(8, "big")
    msg = s.parse_live(frames)
    assert (msg.topic, msg.seq, msg.payload) == (b"kv", 2**40, b"payload")
    for bad in ([b"kv", b"\x00" * 8], [b"kv", b"\x00" * 7, b"p"], [b"a", b"b", b"c", b"d"]):
        with pytest.raises(s.MalformedFrame):
            s.parse_live(bad)


@pytest.mark.parametrize("version,frames_per_reply", [("0.23", 3), ("0.24", 3), ("0.26", 4)])
def test_replay_layouts(version: str, frames_per_reply: int) -> None:
    layout = s.replay_layout(version)
    reply = s.replay_reply_frames(b"id", "kv", 5, b"p", layout)
    assert reply[0] == b"id" and len(reply) - 1 == frames_per_reply
    item = s.parse_replay_reply(reply[1:])
    assert item is not None and (item.seq, item.payload) == (5, b"p")
    assert item.topic == (b"kv" if layout == "0.26" else None)
    end = s.replay_end_frames(b"id", layout)
    assert len(end) - 1 == frames_per_reply and s.parse_replay_reply(end[1:]) is None
    request = s.replay_request_frames(5)
    assert s.parse_replay_request([b"id", *request]) == (b"id", 5)
