"""CPU-tier events produced by vLLM 0.33's own offloading code, through kvroute's bridge.

tests/conformance/offload_producer.py runs in the vLLM environment: a real
`CPUOffloadingManager` and `OffloadingEventsTracker` (spec §10) offload real requests' chunks
into a CPU tier small enough to evict, and vLLM's encoder writes each step's batch. Here the
bridge's decoder, converter and state must hold exactly the chunks vLLM's manager holds, in the
CPU tier and nowhere else, and a snapshot must carry them; the index's per-tier answer must
equal the CPU hit vLLM's manager gives for every probe and GPU hit.
"""

from __future__ import annotations

import subprocess
from typing import Any

import msgspec
import pytest
from vllm_recording import REPO, _unavailable, vllm_python

from kvroute.bridge.convert import ConvertStats, convert_batch, normalise_hash
from kvroute.bridge.state import EngineState
from kvroute.bridge.vllm_schema import BatchDecoder, DecodedStored
from kvroute.indexer import GroupCache, content_keys
from kvroute.indexer.layout import Layout
from kvroute.indexer.tiers import TierIndex
from kvroute.proto.events_pb2 import KvEventBatch, KvGroupEvent, Tier

pytestmark = pytest.mark.vllm

PRODUCER = REPO / "tests" / "conformance" / "offload_producer.py"


@pytest.fixture(scope="module")
def recording() -> dict[str, Any]:
    python = vllm_python()
    if not python.exists():
        _unavailable(f"the vLLM python {python} does not exist")
    run = subprocess.run(
        [str(python), str(PRODUCER)], capture_output=True, timeout=600, cwd=REPO, check=False
    )
    if run.returncode != 0:
        pytest.fail(f"the offload producer failed:\n{run.stderr.decode()[-4000:]}", pytrace=False)
    doc: dict[str, Any] = msgspec.msgpack.decode(run.stdout)
    return doc


def _held(state: EngineState | None) -> set[bytes]:
    """Hashes with a live copy in group 0 of a view."""
    if state is None:
        return set()
    snap = state.snapshot()
    return {h for e in snap.events for h in e.block_hashes if state.copies(0, h) > 0}


def _replayed(snapshot_state: EngineState) -> EngineState:
    """A fresh state fed with another state's snapshot (as a subscriber would rebuild it)."""
    snap = snapshot_state.snapshot()
    batch = KvEventBatch(sequence=0)
    batch.events.extend(snap.events)
    batch.tier_events.extend(snap.tier_lineage)
    batch.tier_events.extend(snap.tier_events)
    fresh = EngineState()
    fresh.apply(batch)
    return fresh


def test_self_describing_cpu_events_rebuild_vllms_cpu_tier(recording: dict[str, Any]) -> None:
    decoder, stats, state = BatchDecoder(), ConvertStats(), EngineState()
    removes = 0
    for seq, step in enumerate(recording["steps"]):
        engine = step["self_describing"]
        batch = convert_batch(decoder.decode(engine["payload"]), seq, stats=stats)
        assert not batch.events, "CPU events must never reach the GPU view"
        assert {e.tier for e in batch.tier_events} <= {Tier.CPU}
        assert all(e.operation != KvGroupEvent.INVALID for e in batch.tier_events)
        removes += sum(e.operation == KvGroupEvent.REMOVE for e in batch.tier_events)
        state.apply(batch)
        expected = {normalise_hash(h) for h in engine["resident"]}
        assert _held(state.tier(Tier.CPU)) == expected, f"step {seq}"
        assert state.blocks == 0
        assert _held(_replayed(state).tier(Tier.CPU)) == expected, f"snapshot at step {seq}"
    assert removes > 0, "the CPU tier must have evicted (the recording is too small)"
    assert stats.placeholders == {} and stats.filtered == 0


def test_placeholder_cpu_events_are_counted_not_placed(recording: dict[str, Any]) -> None:
    decoder, stats, state = BatchDecoder(), ConvertStats(), EngineState()
    stores = 0
    for seq, step in enumerate(recording["steps"]):
        engine = step["placeholder"]
        decoded = decoder.decode(engine["payload"])
        stores += sum(isinstance(e, DecodedStored) for e in decoded.events)
        batch = convert_batch(decoded, seq, stats=stats)
        assert {e.operation for e in batch.tier_events} <= {KvGroupEvent.REMOVE}
        state.apply(batch)
        assert _held(state.tier(Tier.CPU)) == set()
    assert stores > 0 and stats.placeholders == {Tier.CPU: stores}


def _gpu_layout(block_size: int) -> Layout:
    """A worker whose GPU pool is one full-attention group (the recording's model)."""
    gpu = GroupCache()
    declare = KvEventBatch(sequence=0)
    declare.events.add(operation=KvGroupEvent.STORE, kind="full_attention", block_size=block_size)
    gpu.apply(declare)
    return gpu.layout()


def test_tier_index_answers_vllms_cpu_hit_at_every_step(recording: dict[str, Any]) -> None:
    decoder, tiers = BatchDecoder(), TierIndex()
    layout = _gpu_layout(recording["block_size"])
    keys = [content_keys(p) for p in recording["prompts"]]
    checked = credited = 0
    for seq, step in enumerate(recording["steps"]):
        engine = step["self_describing"]
        tiers.apply("w", convert_batch(decoder.decode(engine["payload"]), seq))
        for prompt, gpu_hit, expected in engine["probes"]:
            n = len(recording["prompts"][prompt])
            got = tiers.split("w", layout, keys[prompt], n, gpu_hit)
            assert (got.gpu, got.cpu, got.storage) == (gpu_hit, expected, 0), (
                f"step {seq}, prompt {prompt}, GPU hit {gpu_hit}"
            )
            checked += 1
            credited += expected > 0
    assert checked > 100 and credited > 20
