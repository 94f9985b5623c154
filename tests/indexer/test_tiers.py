"""`TierIndex`: lower tiers per worker against a small reference model (spec §10)."""

from __future__ import annotations

import os
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.indexer import GroupCache, content_keys
from kvroute.indexer.layout import Layout
from kvroute.indexer.tiers import TierIndex, TierTokens
from kvroute.proto.events_pb2 import KvEventBatch, KvGroupEvent, Snapshot, Tier

BLOCK, CHUNK, CHUNKS = 16, 32, 5
STORE, REMOVE, CLEAR = KvGroupEvent.STORE, KvGroupEvent.REMOVE, KvGroupEvent.CLEAR
TIERS = (Tier.CPU, Tier.STORAGE)
GPU_HITS = (0, 16, 32, 48, 64, 96)


def _prompts() -> list[list[int]]:
    shared = list(range(1000, 1000 + 2 * CHUNK))  # prompts 0 and 1 share two chunks
    return [
        shared + list(range(2000, 2000 + 3 * CHUNK + 8)),
        shared + list(range(3000, 3000 + 3 * CHUNK + 8)),
        list(range(4000, 4000 + CHUNKS * CHUNK + 8)),
    ]


PROMPTS = _prompts()
KEYS = [content_keys(p) for p in PROMPTS]


def vhash(tokens: list[int], end: int) -> bytes:
    """A stand-in engine hash of the prefix ending at `end`."""
    return (hash(tuple(tokens[:end])) & (2**64 - 1)).to_bytes(8, "big")


def chunk_event(op: int, prompt: int, chunk: int, tier: int) -> KvGroupEvent:
    tokens = PROMPTS[prompt]
    start = chunk * CHUNK
    ends = range(start + BLOCK, start + CHUNK + 1, BLOCK)
    event = KvGroupEvent(operation=op, block_hashes=[vhash(tokens, e) for e in ends], tier=tier)
    if op == STORE:
        event.parent_block_hash = vhash(tokens, start) if start else b""
        event.token_ids.extend(tokens[start : start + CHUNK])
        event.block_size = BLOCK
        event.kind = "full_attention"
    return event


def gpu_layout() -> Layout:
    gpu = GroupCache()
    declare = KvEventBatch(sequence=0)
    declare.events.add(operation=STORE, kind="full_attention", block_size=BLOCK)
    gpu.apply(declare)
    return gpu.layout()


LAYOUT = gpu_layout()


class Reference:
    """Chunks held per tier, by the prefix they end; vLLM's walk over them."""

    def __init__(self) -> None:
        self.held: Counter[tuple[int, tuple[int, ...]]] = Counter()

    def key(self, prompt: int, chunk: int) -> tuple[int, ...]:
        return tuple(PROMPTS[prompt][: (chunk + 1) * CHUNK])

    def split(self, prompt: int, gpu_hit: int) -> TierTokens:
        n = len(PROMPTS[prompt])
        counted = {Tier.CPU: 0, Tier.STORAGE: 0}
        chunk = gpu_hit // CHUNK
        while (chunk + 1) * CHUNK <= n:
            tier = next((t for t in TIERS if self.held[(t, self.key(prompt, chunk))]), None)
            if tier is None:
                break
            counted[tier] += (chunk + 1) * CHUNK - max(chunk * CHUNK, gpu_hit)
            chunk += 1
        if sum(counted.values()) < CHUNK:
            return TierTokens(gpu_hit)
        return TierTokens(gpu_hit, counted[Tier.CPU], counted[Tier.STORAGE])


OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "store", "remove", "clear"]),
        st.integers(0, 2),
        st.integers(0, CHUNKS - 1),
        st.sampled_from(TIERS),
    ),
    max_size=40,
)


@settings(max_examples=int(os.environ.get("KVROUTE_HYPOTHESIS_EXAMPLES", "150")), deadline=None)
@given(OPS)
def test_split_matches_the_reference(ops: list[tuple[str, int, int, int]]) -> None:
    index, ref = TierIndex(), Reference()
    for seq, (op, prompt, chunk, tier) in enumerate(ops):
        batch = KvEventBatch(sequence=seq)
        key = (tier, ref.key(prompt, chunk))
        if op == "clear":
            batch.events.add(operation=CLEAR)
            ref.held.clear()
        elif op == "store" and (chunk == 0 or ref.held[(tier, ref.key(prompt, chunk - 1))]):
            # vLLM offloads in prefix order: a chunk's parent is in the tier when it arrives.
            batch.tier_events.append(chunk_event(STORE, prompt, chunk, tier))
            ref.held[key] += 1
        elif op == "remove" and ref.held[key]:
            batch.tier_events.append(chunk_event(REMOVE, prompt, chunk, tier))
            ref.held[key] -= 1
        index.apply("w", batch)
        for p, tokens in enumerate(PROMPTS):
            for gpu_hit in GPU_HITS:
                got = index.split("w", LAYOUT, KEYS[p], len(tokens), gpu_hit)
                assert got == ref.split(p, gpu_hit), (seq, p, gpu_hit)


def test_each_tier_is_bounded_and_the_bound_only_lowers_answers() -> None:
    bounded, free = TierIndex(max_entries_per_tier=4), TierIndex()
    for seq in range(CHUNKS):
        batch = KvEventBatch(sequence=seq)
        batch.tier_events.append(chunk_event(STORE, 2, seq, Tier.CPU))
        batch.tier_events.append(chunk_event(STORE, 2, seq, Tier.STORAGE))
        bounded.apply("w", batch)
        free.apply("w", batch)
    sizes = bounded.blocks("w")
    assert sizes[Tier.CPU] <= 4 and sizes[Tier.STORAGE] <= 4
    assert free.blocks("w") == {Tier.CPU: 2 * CHUNKS, Tier.STORAGE: 2 * CHUNKS}
    n = len(PROMPTS[2])
    assert free.split("w", LAYOUT, KEYS[2], n, 0) == TierTokens(0, CHUNKS * CHUNK)
    capped = bounded.split("w", LAYOUT, KEYS[2], n, 0)
    assert capped.cached < CHUNKS * CHUNK


def test_hybrid_layouts_get_nothing_from_lower_tiers() -> None:
    index = TierIndex()
    batch = KvEventBatch(sequence=0)
    batch.tier_events.extend(chunk_event(STORE, 2, c, Tier.CPU) for c in range(CHUNKS))
    index.apply("w", batch)
    gpu = GroupCache()
    declare = KvEventBatch(sequence=0)
    declare.events.add(operation=STORE, kind="full_attention", block_size=BLOCK)
    declare.events.add(
        operation=STORE, group_id=1, kind="sliding_window", sliding_window=64, block_size=BLOCK
    )
    gpu.apply(declare)
    n = len(PROMPTS[2])
    assert index.split("w", LAYOUT, KEYS[2], n, 0).cpu == CHUNKS * CHUNK
    assert index.split("w", gpu.layout(), KEYS[2], n, 0) == TierTokens(0)


def test_snapshot_replaces_the_tiers() -> None:
    index = TierIndex()
    batch = KvEventBatch(sequence=0)
    batch.tier_events.extend(chunk_event(STORE, 2, c, Tier.CPU) for c in range(2))
    index.apply("w", batch)
    n = len(PROMPTS[2])
    assert index.split("w", LAYOUT, KEYS[2], n, 0).cpu == 2 * CHUNK
    replacement = Snapshot(sequence=5, has_sequence=True)
    replacement.tier_events.extend(chunk_event(STORE, 2, c, Tier.STORAGE) for c in range(3))
    index.apply_snapshot("w", replacement)
    assert index.split("w", LAYOUT, KEYS[2], n, 0) == TierTokens(0, 0, 3 * CHUNK)
    index.invalidate("w")
    assert index.split("w", LAYOUT, KEYS[2], n, 0) == TierTokens(0)


def joined(prompt: int, chunks: int, tier: int) -> KvGroupEvent:
    """The first `chunks` chunks of a prompt as one run, as a bridge's snapshot sends them."""
    event = chunk_event(STORE, prompt, 0, tier)
    for c in range(1, chunks):
        part = chunk_event(STORE, prompt, c, tier)
        event.block_hashes.extend(part.block_hashes)
        event.token_ids.extend(part.token_ids)
    return event


def test_a_snapshot_of_joined_chunks_assumes_a_multiple_until_a_live_store() -> None:
    snapshot = Snapshot(sequence=5, has_sequence=True)
    snapshot.tier_events.append(joined(2, 4, Tier.CPU))
    n = len(PROMPTS[2])
    late = TierIndex()
    late.apply_snapshot("w", snapshot)
    # the run of 4 chunks looks like one chunk of 4: a GPU hit of one chunk leaves 3 chunks,
    # less than that, so nothing (vLLM would load 3 chunks: lower, never higher)
    assert late.split("w", LAYOUT, KEYS[2], n, CHUNK) == TierTokens(CHUNK)
    assert late.split("w", LAYOUT, KEYS[2], n, 0) == TierTokens(0, 4 * CHUNK)
    live = KvEventBatch(sequence=6)
    live.tier_events.append(chunk_event(STORE, 2, 4, Tier.CPU))
    late.apply("w", live)  # a live store shows the real chunk
    assert late.split("w", LAYOUT, KEYS[2], n, CHUNK) == TierTokens(CHUNK, 4 * CHUNK)
    # a router that learned the chunk live keeps it across a snapshot it divides
    warm = TierIndex()
    first = KvEventBatch(sequence=0)
    first.tier_events.append(chunk_event(STORE, 0, 0, Tier.CPU))
    warm.apply("w", first)
    warm.apply_snapshot("w", snapshot)
    assert warm.split("w", LAYOUT, KEYS[2], n, CHUNK) == TierTokens(CHUNK, 3 * CHUNK)


def test_a_snapshot_with_the_bridges_chunk_needs_no_live_store() -> None:
    snapshot = Snapshot(sequence=5, has_sequence=True)
    snapshot.tier_events.append(joined(2, 4, Tier.CPU))
    snapshot.tier_chunks.add(tier=Tier.CPU, tokens=CHUNK)
    n = len(PROMPTS[2])
    late = TierIndex()
    late.apply_snapshot("w", snapshot)
    assert late.split("w", LAYOUT, KEYS[2], n, CHUNK) == TierTokens(CHUNK, 3 * CHUNK)
    assert late.split("w", LAYOUT, KEYS[2], 3 * CHUNK, 0) == TierTokens(0, 3 * CHUNK)
    # the bridge's chunk replaces one the router had (an engine restarted with another)
    warm = TierIndex()
    first = KvEventBatch(sequence=0)
    first.tier_events.append(joined(0, 2, Tier.CPU))  # a store of two chunks: 2 x CHUNK
    warm.apply("w", first)
    warm.apply_snapshot("w", snapshot)
    assert warm.split("w", LAYOUT, KEYS[2], n, CHUNK) == TierTokens(CHUNK, 3 * CHUNK)
    # a tier the snapshot holds nothing of keeps its chunk for the stores to come
    empty = Snapshot(sequence=6, has_sequence=True)
    empty.tier_chunks.add(tier=Tier.CPU, tokens=CHUNK)
    late.apply_snapshot("w", empty)
    assert late.split("w", LAYOUT, KEYS[2], n, 0) == TierTokens(0)
    live = KvEventBatch(sequence=7)
    live.tier_events.extend(chunk_event(STORE, 2, c, Tier.CPU) for c in range(2))
    late.apply("w", live)
    assert late.split("w", LAYOUT, KEYS[2], n, CHUNK) == TierTokens(CHUNK, CHUNK)
