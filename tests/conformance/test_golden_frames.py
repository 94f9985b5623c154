"""Frames recorded from real vLLM releases (golden/<version>/, see record_frames.py), decoded and
converted by the bridge, event by event, against the structs the release itself decoded.

No vLLM is needed here: the recordings are committed. Every release in vllm_releases.RELEASES
must have one, or be listed in vllm_releases.UNVERIFIED with the reason.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from vllm_releases import RELEASES, UNVERIFIED, layout_of, support_table

from kvroute.bridge import vllm_schema as s
from kvroute.bridge.convert import convert_batch
from kvroute.proto.events_pb2 import KvGroupEvent
from kvroute.proto.namespace import salt_namespace

GOLDEN = Path(__file__).resolve().parent / "golden"
SUPPORT_DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm-support.md"
RECORDED = sorted(
    (p.parent.name for p in GOLDEN.glob("*/recording.json")),
    key=lambda v: [int(part) for part in v.split(".")],
)


@cache
def recording(version: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((GOLDEN / version / "recording.json").read_text())
    return data


def value(saved: Any) -> Any:
    """A saved struct value back as vLLM held it ({"hex"} -> bytes)."""
    if isinstance(saved, dict):
        return bytes.fromhex(saved["hex"])
    if isinstance(saved, list):
        return [value(item) for item in saved]
    return saved


def live(version: str) -> list[tuple[str, list[bytes], dict[str, Any]]]:
    return [
        (m["name"], [bytes.fromhex(f) for f in m["frames"]], m["batch"])
        for m in recording(version)["live"]
    ]


def test_every_release_is_recorded_or_says_why() -> None:
    assert set(RECORDED) <= set(RELEASES), "a recording of a release the table does not list"
    missing = set(RELEASES) - set(RECORDED) - set(UNVERIFIED)
    assert not missing, f"neither recorded nor listed as unverified: {sorted(missing)}"
    # Every wire version the bridge claims has at least one recorded release.
    claimed = {v for v in s.KNOWN_WIRE_VERSIONS}
    covered = {v for v in claimed if any(r == v or r.startswith(v + ".") for r in RECORDED)}
    assert covered == claimed


def test_support_doc_table_is_current() -> None:
    # Regenerate with `python -m tests.conformance.record_frames --print-table`.
    assert support_table(set(RECORDED), UNVERIFIED) in SUPPORT_DOC.read_text()


@pytest.mark.parametrize("version", RECORDED)
def test_recording_is_the_listed_release_and_layout(version: str) -> None:
    rec = recording(version)
    layout = layout_of(version)
    assert rec["vllm_version"] == version
    assert rec["command"] == f"python -m tests.conformance.record_frames --versions {version}"
    assert rec["kv_events_sha256"].startswith(RELEASES[version][1])
    fields = rec["struct_fields"]
    assert fields["BlockStored"] == list(layout.stored)
    assert fields["BlockRemoved"] == list(layout.removed)
    assert fields["events_array_like"] == (layout.events == "array")
    assert fields["batch_array_like"] is True
    assert fields["bytes_hashes"] == layout.bytes_hashes
    # The scenarios a layout's fields allow were all recorded.
    names = {name for name, _, _ in live(version)}
    assert {"store_from_token_0", "remove_one_hash_each", "clear", "lora"} <= names
    assert ("multi_group" in names) == ("group_idx" in layout.stored)
    assert ("cache_salt" in names) == ("extra_keys" in layout.stored)


_DECODED: dict[str, type] = {
    "BlockStored": s.DecodedStored,
    "BlockRemoved": s.DecodedRemoved,
    "AllBlocksCleared": s.DecodedCleared,
}


@pytest.mark.parametrize("version", RECORDED)
def test_live_frames_decode_to_what_vllm_decoded(version: str) -> None:
    decoder = s.BatchDecoder()  # one per stream, as the bridge has
    topic = recording(version)["topic"].encode()
    for seq, (name, frames, saved) in enumerate(live(version)):
        message = s.parse_live(frames)
        assert (message.topic, message.seq) == (topic, seq), name
        batch = decoder.decode(message.payload)
        assert batch.ts == saved["ts"] and batch.data_parallel_rank == saved["data_parallel_rank"]
        assert len(batch.events) == len(saved["events"]), name
        for got, want in zip(batch.events, saved["events"], strict=True):
            assert isinstance(got, _DECODED[want["type"]]), name
            fields = {k: value(v) for k, v in want.items() if k != "type"}
            # Every field the release has, decoded as vLLM decoded it; the rest absent.
            for field in got.__struct_fields__:
                assert getattr(got, field) == fields.get(field), (name, field)
            assert set(fields) <= set(got.__struct_fields__), name
    assert decoder.unknown_field_batches == 0, decoder.unknown_field_names


@pytest.mark.parametrize("version", RECORDED)
def test_encoder_reproduces_vllm_bytes(version: str) -> None:
    # The simulated engines encode with kvroute's encoder: byte for byte what vLLM sends.
    records = {"BlockStored": s.BlockStored, "BlockRemoved": s.BlockRemoved}
    for name, frames, saved in live(version):
        events: list[s.Event] = []
        for event in saved["events"]:
            fields = {k: value(v) for k, v in event.items() if k != "type"}
            if "extra_keys" in fields and fields["extra_keys"] is not None:
                fields["extra_keys"] = [
                    None if e is None else tuple(e) for e in fields["extra_keys"]
                ]
            cls = records.get(event["type"])
            events.append(cls(**fields) if cls else s.AllBlocksCleared())
        payload = s.encode_batch(saved["ts"], events, saved["data_parallel_rank"], version)
        assert payload == frames[2], name


# ---------------------------------------------------------------------------------------------
# Conversion: what the router receives for each recorded event
# ---------------------------------------------------------------------------------------------


def _hash(saved: Any) -> bytes:
    raw = value(saved)
    return raw if isinstance(raw, bytes) else (raw & (1 << 64) - 1).to_bytes(8, "big")


def _store(ev: dict[str, Any], **more: Any) -> KvGroupEvent:
    return KvGroupEvent(
        operation=KvGroupEvent.STORE,
        group_id=ev.get("group_idx") or 0,
        block_hashes=[_hash(h) for h in ev["block_hashes"]],
        parent_block_hash=b""
        if ev["parent_block_hash"] is None
        else _hash(ev["parent_block_hash"]),
        token_ids=ev["token_ids"],
        block_size=ev["block_size"],
        kind=ev.get("kv_cache_spec_kind") or "",
        sliding_window=ev.get("kv_cache_spec_sliding_window") or 0,
        lora_name=ev.get("lora_name") or "",
        **more,
    )


def _split(ev: dict[str, Any], at: int) -> list[KvGroupEvent]:
    first, second = _store(ev), _store(ev, unmatchable=True)
    del first.block_hashes[at:], first.token_ids[at * ev["block_size"] :]
    del second.block_hashes[:at], second.token_ids[: at * ev["block_size"]]
    second.parent_block_hash = first.block_hashes[-1]
    return [first, second]


def expected(scenario: str, ev: dict[str, Any]) -> list[KvGroupEvent]:
    """What the bridge must make of one recorded event (spec §2-§5, the converter's rules)."""
    kind = ev["type"]
    if kind == "AllBlocksCleared":
        return [KvGroupEvent(operation=KvGroupEvent.CLEAR)]
    if ev.get("medium") not in (None, "GPU") or ev.get("locality") not in (None, "LOCAL"):
        return []  # offloaded or remote blocks are not in this engine's GPU cache
    if ev.get("ownership") is not None:
        return []
    if kind == "BlockRemoved":
        return [
            KvGroupEvent(
                operation=KvGroupEvent.REMOVE,
                group_id=ev.get("group_idx") or 0,
                block_hashes=[_hash(h) for h in ev["block_hashes"]],
            )
        ]
    if ev["lora_id"] is not None and not ev.get("lora_name"):
        return [_store(ev, unmatchable=True)]  # a LoRA known only by its engine-internal id
    if scenario == "lookahead":
        return [_store(ev, unmatchable=True)]
    if scenario in ("cache_salt", "lora_and_salt"):
        return [_store(ev, cache_namespace=salt_namespace("salt-xyz"))]  # never the raw salt
    if scenario == "multimodal_key_on_second_block":
        return _split(ev, 1)
    return [_store(ev)]


@pytest.mark.parametrize("version", RECORDED)
def test_conversion_event_by_event(version: str) -> None:
    decoder = s.BatchDecoder()
    for seq, (name, frames, saved) in enumerate(live(version)):
        batch = convert_batch(decoder.decode(frames[2]), seq)
        assert (batch.sequence, batch.timestamp) == (seq, saved["ts"])
        assert batch.dp_rank == saved["data_parallel_rank"]
        want = [out for ev in saved["events"] for out in expected(name, ev)]
        assert list(batch.events) == want, name
    # The recordings exercise every kind of outcome.
    all_events = [
        e
        for seq, (_, frames, _) in enumerate(live(version))
        for e in convert_batch(s.BatchDecoder().decode(frames[2]), seq).events
    ]
    ops = {e.operation for e in all_events}
    assert ops == {KvGroupEvent.STORE, KvGroupEvent.REMOVE, KvGroupEvent.CLEAR}
    assert any(e.unmatchable for e in all_events)


@pytest.mark.parametrize("version", RECORDED)
def test_replay_replies_in_the_release_layout(version: str) -> None:
    rec = recording(version)
    layout = layout_of(version)
    assert s.replay_layout(version) == layout.replay
    payloads = [frames[2] for _, frames, _ in live(version)]
    topic = rec["topic"].encode()
    width = 4 if layout.replay == "0.26" else 3
    for replay in rec["replay"]:
        replies = [[bytes.fromhex(f) for f in reply] for reply in replay["frames"]]
        start = replay["start_seq"]
        assert all(len(reply) == width for reply in replies)
        items = [s.parse_replay_reply(reply) for reply in replies]
        assert items[-1] is None  # the end marker
        got = [(i.seq, i.payload, i.topic) for i in items[:-1] if i is not None]
        want_topic = topic if layout.replay == "0.26" else None
        assert got == [(q, payloads[q], want_topic) for q in range(start, len(payloads))]
    # The bridge's end-marker and reply encoders match too (the simulated engines use them).
    end = [bytes.fromhex(f) for f in rec["replay"][0]["frames"][-1]]
    assert s.replay_end_frames(b"id", layout.replay)[1:] == end
    first = [bytes.fromhex(f) for f in rec["replay"][0]["frames"][0]]
    start = rec["replay"][0]["start_seq"]
    reply = s.replay_reply_frames(b"id", topic, start, payloads[start], layout.replay)
    assert reply[1:] == first
