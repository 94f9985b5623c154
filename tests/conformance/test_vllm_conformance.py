"""kvroute against vLLM 0.33 itself: the bridge's decoder and converter on vLLM's real frames,
and the predicted reuse against vLLM's own `get_computed_blocks` on every probe.

The recording comes from tests/conformance/vllm_driver.py (see conftest.py). Scenarios named
`limit_*` demonstrate what events cannot carry; see docs/indexer.md, "Known limits of
event-based prediction".
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec
import pytest
from event_oracle import EventOracle
from vllm_recording import SCENARIOS, at_each_probe, converted, probe_namespace

from kvroute.bridge.convert import ConvertStats
from kvroute.bridge.state import EngineState
from kvroute.indexer import GroupCache, Namespace, WorkerScore
from kvroute.proto.events_pb2 import KvGroupEvent
from kvroute.proto.namespace import salt_namespace

pytestmark = pytest.mark.vllm

PLAIN = [name for name in SCENARIOS if not name.startswith("limit_")]
# Known limits of event-based prediction (docs/indexer.md): the direction in which an answer
# computed from events alone departs from vLLM's, and the alignment that fixes it when one does.
LIMITS: dict[str, tuple[str, int | None]] = {
    "limit_nonprefix_lcm": ("over", 64),
    "limit_pmu16_fa64": ("under", None),
    "limit_swa_only_r0": ("under", None),
    "limit_mamba_only": ("under", None),
    "limit_lora_path": ("over", None),
    "limit_prompt_logprobs": ("over", None),
    "limit_report_mode_full": ("over", None),
}
MASK64 = (1 << 64) - 1


def _wire_hash(value: int | bytes) -> bytes:
    return value if isinstance(value, bytes) else (value & MASK64).to_bytes(8, "big")


@pytest.mark.parametrize("name", SCENARIOS)
def test_converter_keeps_every_vllm_event(
    scenarios_by_name: dict[str, dict[str, Any]], name: str
) -> None:
    sc = scenarios_by_name[name]
    stats = ConvertStats()
    batches = list(converted(sc, stats))
    assert stats.invalid == stats.filtered == stats.unmatchable == stats.split == 0
    for (_topic, seq_frame, payload), batch in zip(sc["frames"], batches, strict=True):
        ts, raw_events, dp_rank = msgspec.msgpack.decode(payload)
        assert batch.sequence == int.from_bytes(seq_frame, "big")
        assert batch.timestamp == ts and batch.dp_rank == dp_rank == sc["dp_rank"]
        assert len(batch.events) == len(raw_events)
        for raw, event in zip(raw_events, batch.events, strict=True):
            if raw["type"] == "BlockStored":
                assert event.operation == KvGroupEvent.STORE
                assert list(event.block_hashes) == [_wire_hash(h) for h in raw["block_hashes"]]
                parent = raw["parent_block_hash"]
                assert event.parent_block_hash == (b"" if parent is None else _wire_hash(parent))
                assert list(event.token_ids) == raw["token_ids"]
                assert event.block_size == raw["block_size"]
                assert event.group_id == raw["group_idx"]
                assert event.kind == raw["kv_cache_spec_kind"]
                assert event.sliding_window == (raw.get("kv_cache_spec_sliding_window") or 0)
                assert event.lora_name == (raw["lora_name"] or "")
                # The salt is published bare in the extra keys of the block at token 0.
                extra = raw.get("extra_keys") or [None]
                first = extra[0] or []
                salts = [k for k in first if k != raw["lora_name"]] if parent is None else []
                # ...and reaches the wire only as its digest
                assert event.cache_namespace == salt_namespace(salts[0] if salts else "")
                assert not event.unmatchable
            elif raw["type"] == "BlockRemoved":
                assert event.operation == KvGroupEvent.REMOVE
                assert list(event.block_hashes) == [_wire_hash(raw["block_hashes"][0])]
                assert event.group_id == raw["group_idx"]
            else:
                assert event.operation == KvGroupEvent.CLEAR


def _namespace(probe: dict[str, Any]) -> tuple[str, str]:
    return (probe["lora_name"], salt_namespace(probe["cache_salt"] or ""))


def _oracle_answers(
    sc: dict[str, Any], alignment: int | None = None
) -> list[tuple[int, dict[int, int]]]:
    oracle = EventOracle(alignment_override=alignment)
    return at_each_probe(
        sc["probes"],
        list(converted(sc)),
        oracle.apply,
        lambda probe: oracle.per_group(probe["tokens"], _namespace(probe)),
    )


def _assert_departs_only(direction: str, pairs: list[tuple[int, int]], what: str) -> None:
    """(vLLM's hit, predicted) pairs depart, and only in `direction` ("over" or "under")."""
    over = [(native, predicted) for native, predicted in pairs if predicted > native]
    under = [(native, predicted) for native, predicted in pairs if predicted < native]
    print(f"{what}: {len(pairs)} probes, {len(over)} over, {len(under)} under vLLM")
    if direction == "over":
        assert over and not under, (over, under)
    else:
        assert under and not over, (over, under)


def _describe(probe: dict[str, Any], predicted: int | None, groups: object) -> str:
    return (
        f"probe {probe['label']!r} after batch {probe['after']}, {len(probe['tokens'])} tokens, "
        f"namespace {_namespace(probe)}: vLLM {probe['hit']} per group {probe['per_group']}, "
        f"predicted {predicted} per group {groups}"
    )


@pytest.mark.parametrize("name", PLAIN)
def test_events_carry_vllm_hits(scenarios_by_name: dict[str, dict[str, Any]], name: str) -> None:
    """The brute-force oracle (event_oracle.py) reproduces vLLM's hit from the events alone.

    This validates the recording and the reference's rules; kvroute's indexer is held to the
    same answers in test_indexer_matches_vllm.
    """
    sc = scenarios_by_name[name]
    answers = _oracle_answers(sc)
    wrong = [
        _describe(p, joint, own)
        for p, (joint, own) in zip(sc["probes"], answers, strict=True)
        if joint != p["hit"]
    ]
    tally = Counter(
        "agree" if joint == p["hit"] else "differ"
        for p, (joint, _) in zip(sc["probes"], answers, strict=True)
    )
    print(f"{name}: oracle {dict(tally)} of {len(answers)} probes")
    assert not wrong, f"{len(wrong)} of {len(answers)} probes differ:\n" + "\n".join(wrong[:10])


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_known_limits_are_real(scenarios_by_name: dict[str, dict[str, Any]], name: str) -> None:
    """Each documented limit shows up on vLLM's own data, in one direction only."""
    sc = scenarios_by_name[name]
    direction, alignment = LIMITS[name]
    pairs = [
        (p["hit"], joint) for p, (joint, _) in zip(sc["probes"], _oracle_answers(sc), strict=True)
    ]
    _assert_departs_only(direction, pairs, f"{name} (event oracle)")
    if alignment is not None:
        fixed = _oracle_answers(sc, alignment)
        assert [joint for joint, _ in fixed] == [p["hit"] for p in sc["probes"]]


def _indexer_answers(sc: dict[str, Any], alignment: int | None = None) -> list[WorkerScore]:
    """kvroute's GroupCache fed the converted frames, asked every probe at its point."""
    cache = GroupCache(hash_unit=16)
    if alignment is not None:
        cache.set_alignment(alignment)
    return at_each_probe(
        sc["probes"],
        list(converted(sc)),
        cache.apply,
        lambda probe: cache.explain(probe["tokens"], probe_namespace(probe)),
    )


def _per_group(score: WorkerScore) -> dict[int, int | None]:
    return {g.group_id: g.accepted_tokens for g in score.groups}


@pytest.mark.parametrize("name", PLAIN)
def test_indexer_matches_vllm(scenarios_by_name: dict[str, dict[str, Any]], name: str) -> None:
    """`indexer.GroupCache.reusable_tokens` equals vLLM's native hit on every probe.

    Before the first batch there is no evidence, which the index reports as None.
    """
    sc = scenarios_by_name[name]
    answers = _indexer_answers(sc)
    oracle = _oracle_answers(sc)
    wrong = []
    for probe, score, (joint, _) in zip(sc["probes"], answers, oracle, strict=True):
        expected = probe["hit"] if probe["after"] else None
        if score.reusable_tokens != expected:
            detail = _describe(probe, score.reusable_tokens, _per_group(score))
            wrong.append(f"{detail}; event oracle {joint} (alignment {score.alignment})")
    agree = len(answers) - len(wrong)
    print(f"{name}: indexer agrees with vLLM on {agree} of {len(answers)} probes")
    assert not wrong, f"{len(wrong)} of {len(answers)} probes differ:\n" + "\n".join(wrong[:10])


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_indexer_on_known_limits(scenarios_by_name: dict[str, dict[str, Any]], name: str) -> None:
    """Where events cannot carry what vLLM knows, the index departs only in the documented
    direction, and a configured alignment removes the departure where one can."""
    sc = scenarios_by_name[name]
    direction, alignment = LIMITS[name]
    pairs = [
        (p["hit"], score.reusable_tokens)
        for p, score in zip(sc["probes"], _indexer_answers(sc), strict=True)
        if p["after"]
    ]
    known = [(native, predicted) for native, predicted in pairs if predicted is not None]
    assert len(known) == len(pairs), "no evidence after a batch"
    _assert_departs_only(direction, known, f"{name} (indexer)")
    if alignment is not None:
        fixed = _indexer_answers(sc, alignment)
        assert [s.reusable_tokens for s in fixed] == [p["hit"] for p in sc["probes"]]


RESYNC_POINTS = 4


@pytest.mark.parametrize("name", PLAIN)
def test_snapshot_resync_matches_vllm(
    scenarios_by_name: dict[str, dict[str, Any]], name: str
) -> None:
    """A router that (re)joins at any point from the bridge's snapshot, then follows the live
    batches, answers every later probe as vLLM does: with a full-attention group, and
    without one (sliding window only, Mamba + sliding window), where the snapshot's lineage
    places window tails whose prefix was evicted."""
    sc = scenarios_by_name[name]
    batches = list(converted(sc))
    points = sorted({len(batches) * i // (RESYNC_POINTS + 1) for i in range(1, RESYNC_POINTS + 1)})
    wrong = []
    for point in points:
        state = EngineState()
        for batch in batches[:point]:
            state.apply(batch)
        cache = GroupCache(hash_unit=16)
        cache.apply_snapshot(state.snapshot())
        applied = point
        for probe in sc["probes"]:
            if probe["after"] < point or not probe["after"]:
                continue
            while applied < probe["after"]:
                cache.apply(batches[applied])
                applied += 1
            got = cache.reusable_tokens(probe["tokens"], Namespace(*_namespace(probe)))
            if got != probe["hit"]:
                wrong.append(f"resync at batch {point}: {_describe(probe, got, '')}")
    assert not wrong, f"{len(wrong)} probes differ:\n" + "\n".join(wrong[:10])


@pytest.mark.parametrize("name", PLAIN)
def test_capped_index_errs_low(scenarios_by_name: dict[str, dict[str, Any]], name: str) -> None:
    """With its history capped far below the workload, the index still never predicts more
    reuse than vLLM has (a lower score, never a wrong one)."""
    sc = scenarios_by_name[name]
    cache = GroupCache(hash_unit=16, max_entries=48, max_pending=8)
    answers = at_each_probe(
        sc["probes"],
        list(converted(sc)),
        cache.apply,
        lambda probe: cache.reusable_tokens(probe["tokens"], probe_namespace(probe)),
    )
    over = [
        _describe(probe, got, "")
        for probe, got in zip(sc["probes"], answers, strict=True)
        if got is not None and got > probe["hit"]
    ]
    stats = cache.stats()
    print(f"{name}: capped index evicted {stats.evicted}, pending dropped {stats.pending_evicted}")
    assert not over, f"{len(over)} probes over vLLM:\n" + "\n".join(over[:10])
