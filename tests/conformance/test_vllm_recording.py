"""The recording of vLLM 0.33 itself: its wire format, its replay socket, its native hits.

These check the harness (tests/conformance/vllm_driver.py and kvroute/sim/vllm_backend.py) against
the
reference (docs/reference/vllm-kv-events.md §1-§2 and §7.6), so that the comparisons built on the
recording compare against vLLM as it really behaves.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from vllm_recording import FLEETS, SCENARIOS

pytestmark = pytest.mark.vllm

END_SEQ = b"\xff" * 8
STORED_KEYS = {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"}


def test_recording_covers_every_scenario(vllm_recording: dict[str, Any]) -> None:
    assert vllm_recording["vllm_version"] == "0.33.0"
    assert [sc["name"] for sc in vllm_recording["scenarios"]] == SCENARIOS
    assert [fleet["name"] for fleet in vllm_recording["fleets"]] == FLEETS


def test_native_hits_reproduce_the_reference_examples(vllm_recording: dict[str, Any]) -> None:
    checked = []
    for sc in vllm_recording["scenarios"]:
        for probe in sc["probes"]:
            if probe["expect"] is not None:
                checked.append((sc["name"], probe["label"], probe["hit"], probe["expect"]))
    wrong = [c for c in checked if c[2] != c[3]]
    assert len(checked) >= 15
    assert not wrong, f"(scenario, probe, vLLM hit, reference §7.6) mismatches: {wrong}"


def _hash_ok(value: Any, int_hashes: bool) -> bool:
    if int_hashes:
        return type(value) is int and 0 <= value < 1 << 64
    return type(value) is bytes and len(value) == 32


@pytest.mark.parametrize("name", SCENARIOS)
def test_live_frames_are_the_033_wire_format(
    scenarios_by_name: dict[str, dict[str, Any]], name: str
) -> None:
    sc = scenarios_by_name[name]
    frames = sc["frames"]
    assert len(frames) == sc["stats"]["batches"] > 0
    int_hashes = sc["int_hashes"]
    groups = sc["config"]["groups"]
    for seq, message in enumerate(frames):
        topic, seq_frame, payload = message  # exactly 3 frames
        assert topic == sc["topic"].encode()
        assert seq_frame == seq.to_bytes(8, "big")
        assert payload[:2] == b"\x93\xcb"  # array of 3 starting with a float64 ts
        ts, events, dp_rank = msgspec.msgpack.decode(payload)
        assert isinstance(ts, float) and dp_rank == sc["dp_rank"]
        assert events
        for event in events:
            assert isinstance(event, dict) and next(iter(event)) == "type"
            kind = event["type"]
            if kind == "BlockStored":
                assert event.keys() >= STORED_KEYS and "lora_name" in event
                assert event["medium"] == "GPU"
                group = groups[event["group_idx"]]
                assert event["kv_cache_spec_kind"] == group["kind"]
                assert event.get("kv_cache_spec_sliding_window") == group["sliding_window"]
                assert all(_hash_ok(h, int_hashes) for h in event["block_hashes"])
                parent = event["parent_block_hash"]
                assert parent is None or _hash_ok(parent, int_hashes)
                # A store spans whole blocks of its own size (a partial entry: the hash unit).
                assert len(event["token_ids"]) % event["block_size"] == 0
                assert len(event["block_hashes"]) <= len(event["token_ids"]) // event["block_size"]
            elif kind == "BlockRemoved":
                assert len(event["block_hashes"]) == 1  # one hash per removal (§5.6)
                assert _hash_ok(event["block_hashes"][0], int_hashes)
                assert event["medium"] == "GPU" and "group_idx" in event
            else:
                assert event == {"type": "AllBlocksCleared"}


@pytest.mark.parametrize("name", SCENARIOS)
def test_replay_socket_resends_the_live_batches(
    scenarios_by_name: dict[str, dict[str, Any]], name: str
) -> None:
    sc = scenarios_by_name[name]
    start = sc["replay"]["start_seq"]
    replies = sc["replay"]["frames"]
    live = sc["frames"][start:]
    topic = sc["topic"].encode()
    # 0.26+ layout as a DEALER sees it: [b"", topic, seq, payload], then the end marker.
    assert replies[:-1] == [[b"", topic, m[1], m[2]] for m in live]
    assert replies[-1] == [b"", b"", END_SEQ, b""]


@pytest.mark.parametrize("name", SCENARIOS)
def test_native_answers_are_consistent(
    scenarios_by_name: dict[str, dict[str, Any]], name: str
) -> None:
    sc = scenarios_by_name[name]
    cacheable = [g["kind"] != "circular_buffer" for g in sc["config"]["groups"]]
    probes = sc["probes"]
    for probe in probes:
        hit = probe["hit"]
        assert 0 <= hit <= len(probe["tokens"]) - 1
        assert hit % sc["alignment"] == 0
        assert 0 <= probe["after"] <= len(sc["frames"])
        # Every group accepts the joint hit, so its own longest hit is at least as long.
        per_group = [h for h, c in zip(probe["per_group"], cacheable, strict=True) if c]
        assert min(per_group) >= hit
    if not sc["limit"] and len(probes) > 100:
        hits = [p["hit"] for p in probes]
        assert sum(h > 0 for h in hits) > len(hits) // 20, "too few cache hits to be a test"
        assert sum(h == 0 for h in hits) > len(hits) // 10, "too few misses to be a test"
