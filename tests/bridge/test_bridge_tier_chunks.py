"""A router that subscribes late reads a worker's CPU tier as one that followed it live.

vLLM's `OffloadingConnector` offloads chunks of several GPU blocks (spec section 10.3); a
router learns the chunk from the tier's live stores (one store = one chunk). The bridge's
snapshot joins a chain of chunks into one run, so it also says which chunk it learned per
tier (`Snapshot.tier_chunks`). Here one bridge state is fed engine batches, one router view
follows its output live and another loads its snapshot at each step; both must give the
same per-tier answer for prompts that end inside, at and beyond what the tier holds."""

from __future__ import annotations

import pytest

from kvroute.bridge.state import EngineState
from kvroute.proto.events_pb2 import KvEventBatch, KvGroupEvent, Snapshot, Tier
from kvroute.router.routing.fleet_index_view import FleetIndexView
from kvroute.router.routing.index_view import TierReuse

BLOCK, CHUNK = 16, 4  # tokens per GPU block; GPU blocks per offloaded chunk
PROMPT = list(range(7000, 7000 + 12 * BLOCK + 1))  # 12 blocks (3 chunks) and one token more
OTHER = [*PROMPT[: 6 * BLOCK], *range(9000, 9000 + 6 * BLOCK + 1)]  # shares chunk 0 and half
LENGTHS = (60, 100, 150, 193)
OP = KvGroupEvent


def store(first: int, count: int, tier: int = Tier.GPU) -> KvGroupEvent:
    """Blocks first..first+count-1 of PROMPT as the bridge converts them (hash of block i:
    i + 1; a lower tier's store is one self-describing chunk)."""
    return OP(
        operation=OP.STORE,
        block_hashes=[(first + i + 1).to_bytes(8, "big") for i in range(count)],
        parent_block_hash=first.to_bytes(8, "big") if first else b"",
        token_ids=PROMPT[BLOCK * first : BLOCK * (first + count)],
        block_size=BLOCK,
        kind="full_attention",
        tier=tier,
    )


def remove(first: int, count: int, tier: int = Tier.GPU) -> KvGroupEvent:
    hashes = [(first + i + 1).to_bytes(8, "big") for i in range(count)]
    return OP(operation=OP.REMOVE, block_hashes=hashes, tier=tier)


def chunk(c: int) -> KvGroupEvent:
    return store(c * CHUNK, CHUNK, Tier.CPU)


def batch(seq: int, *events: KvGroupEvent) -> KvEventBatch:
    out = KvEventBatch(sequence=seq)
    for event in events:
        (out.events if event.tier == Tier.GPU else out.tier_events).append(event)
    return out


# Each step is one engine batch; after each, the late router must answer as the live one.
STEPS = {
    # the GPU held 12 blocks and offloaded them as three chunks, then evicted all but two
    "gpu_keeps_two_blocks": [
        batch(0, store(0, 12)),
        batch(1, chunk(0), chunk(1), chunk(2)),
        batch(2, remove(2, 10)),
    ],
    # the CPU tier then evicts the first chunk and the GPU its last blocks: nothing loads
    "first_chunk_evicted": [
        batch(0, store(0, 12)),
        batch(1, chunk(0), chunk(1), chunk(2)),
        batch(2, remove(2, 10)),
        batch(3, remove(0, CHUNK, Tier.CPU)),
        batch(4, remove(0, 2)),
    ],
    # the middle chunk goes: only the first loads
    "middle_chunk_evicted": [
        batch(0, store(0, 12)),
        batch(1, chunk(0), chunk(1), chunk(2)),
        batch(2, remove(0, 12)),
        batch(3, remove(CHUNK, CHUNK, Tier.CPU)),
    ],
}


def answers(view: FleetIndexView) -> dict[tuple[str, int], TierReuse | None]:
    out = {}
    for name, prompt in (("prompt", PROMPT), ("other", OTHER)):
        for n in LENGTHS:
            gpu = view.score(prompt[:n])
            out[name, n] = view.tiers(prompt[:n], gpu).get("w0")
    return out


def late(snapshot: Snapshot) -> FleetIndexView:
    view = FleetIndexView(BLOCK)
    view.apply_snapshot("w0", snapshot)
    return view


@pytest.mark.parametrize("steps", STEPS.values(), ids=list(STEPS))
def test_a_late_router_reads_the_cpu_tier_as_a_live_one(steps: list[KvEventBatch]) -> None:
    state, live = EngineState(), FleetIndexView(BLOCK)
    credited = False
    for step in steps:
        live.apply("w0", state.apply(step))
        expected = answers(live)
        assert answers(late(state.snapshot())) == expected
        credited = credited or any(expected.values())
    assert credited


def test_the_first_scenario_credits_what_vllm_loads() -> None:
    """The live answers the late router must match, checked against spec section 10.4."""
    state, live = EngineState(), FleetIndexView(BLOCK)
    for step in STEPS["gpu_keeps_two_blocks"]:
        live.apply("w0", state.apply(step))
    got = answers(live)
    # from the chunk holding the GPU hit (32 tokens): up to the last whole chunk in the prompt
    assert got["prompt", 193] == TierReuse(cpu=160)
    assert got["prompt", 150] == TierReuse(cpu=96)
    # less than a chunk beyond the GPU hit gives nothing: the rest of chunk 0 (32 tokens)
    assert got["prompt", 100] is None and got["prompt", 60] is None
    assert got["other", 193] is None  # OTHER leaves PROMPT inside chunk 1


def chunks(snapshot: Snapshot) -> dict[int, int]:
    out = {c.tier: c.tokens for c in snapshot.tier_chunks}
    assert len(out) == len(snapshot.tier_chunks)  # one entry per tier
    return out


def test_the_snapshot_says_each_tiers_chunk_until_the_view_restarts() -> None:
    state = EngineState()
    state.apply(batch(0, store(0, 12)))
    assert not state.snapshot().tier_chunks  # no lower tier
    placeholder = OP(operation=OP.STORE, block_hashes=[b"\x01" * 8], tier=Tier.STORAGE)
    state.apply(batch(1, chunk(0), placeholder))  # vLLM's default payload shows no chunk
    assert chunks(state.snapshot()) == {Tier.CPU: CHUNK * BLOCK}
    state.apply(batch(2, store(4, 2, Tier.STORAGE), chunk(1)))
    wire = Snapshot.FromString(state.snapshot().SerializeToString())
    assert chunks(wire) == {Tier.CPU: CHUNK * BLOCK, Tier.STORAGE: 2 * BLOCK}
    # the engine's setting: it stays when the tier empties or is discarded
    state.apply(batch(3, remove(0, 2 * CHUNK, Tier.CPU)))
    state.apply(batch(4, OP(operation=OP.INVALID, tier=Tier.STORAGE)))
    state.apply(batch(5, OP(operation=OP.CLEAR)))
    snap = state.snapshot()
    assert not any(e.block_hashes for e in snap.tier_events)
    assert chunks(snap) == {Tier.CPU: 64, Tier.STORAGE: 32}
    state.reset()  # an engine restart: learned again from its stores
    assert not state.snapshot().tier_chunks
