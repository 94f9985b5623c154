"""The worked examples of vllm-kv-events.md §7.6 (A-D), built from the events that §5.2,
§5.3, §5.4 and §6.4 describe, checked in GroupCache and FleetIndex alike."""

from __future__ import annotations

import random

import pytest

from kvroute.indexer import FleetIndex, GroupCache
from kvroute.proto import events_pb2 as pb
from tests.indexer.events import (
    FULL,
    MAMBA,
    SWA,
    batch,
    engine_hashes,
    remove,
    store,
)

FA, SW, MB = 0, 1, 2  # group ids: full attention, sliding window (W=32), Mamba


class Both:
    """A GroupCache and a one-worker FleetIndex fed the same batches."""

    def __init__(self) -> None:
        self.cache = GroupCache()
        self.fleet = FleetIndex()
        self.seq = 0

    def send(self, *events: pb.KvGroupEvent) -> None:
        b = batch(self.seq, *events)
        self.seq += 1
        self.cache.apply(b)
        self.fleet.apply("w", b)

    def hit(self, tokens: list[int]) -> int | None:
        got = self.cache.reusable_tokens(tokens)
        assert self.fleet.score(tokens)["w"] == got
        assert self.fleet.explain(tokens)["w"].reusable_tokens == got
        return got

    def per_group(self, tokens: list[int]) -> list[int | None]:
        return [g.accepted_tokens for g in self.cache.explain(tokens).groups]


def _tokens(rng: random.Random, n: int, lo: int) -> list[int]:
    return [rng.randrange(lo, lo + 1000) for _ in range(n)]


def test_a_full_attention_recomputes_the_last_block() -> None:
    """A. Full attention only, block 16: a fully cached 96-token prompt hits 80."""
    prompt = _tokens(random.Random(0), 96, 1000)
    h = engine_hashes(prompt)
    w = Both()
    w.send(store(FA, h[:6], prompt, 16, FULL))
    assert w.hit(prompt) == 80  # cap 95, aligned down to 80
    assert w.hit([*prompt, 1]) == 96
    assert w.hit(prompt[:50]) == 48


@pytest.fixture
def example_b() -> tuple[Both, list[int], list[bytes], list[bytes]]:
    """B. FA(16) + SWA(W=32, 16) + Mamba(16), default retention: A (100 tokens), then B
    sharing A's first 64 tokens."""
    rng = random.Random(1)
    a = _tokens(rng, 100, 1000)
    b = a[:64] + _tokens(rng, 36, 5000)
    ha, hb = engine_hashes(a), engine_hashes(b)
    w = Both()
    # §5.2: A's prefill stores [h0..h5] densely; the SWA tail [h4, h5] and the Mamba
    # state [h5] are sparse (96 tokens each, parent nil) and resolve through FA's hashes.
    w.send(
        store(FA, ha[:6], a[:96], 16, FULL),
        store(SW, ha[4:6], a[:96], 16, SWA, window=32),
        store(MB, ha[5:6], a[:96], 16, MAMBA),
    )
    # §5.3: B's joint hit was 0 (SWA/Mamba had nothing at <= 64), so its first chunk
    # stops at the junction 64 and stores FA h0..h3 again (second copies), the SWA tail
    # [h2, h3] and the Mamba state [h3], all with parent nil.
    w.send(
        store(FA, hb[:4], b[:64], 16, FULL),
        store(SW, hb[2:4], b[:64], 16, SWA, window=32),
        store(MB, hb[3:4], b[:64], 16, MAMBA),
    )
    w.send(
        store(FA, hb[4:6], b[64:96], 16, FULL, parent=hb[3]),
        store(SW, hb[4:6], b[64:96], 16, SWA, window=32, parent=hb[3]),
        store(MB, hb[5:6], b[64:96], 16, MAMBA, parent=hb[3]),
    )
    return w, a, ha, hb


def test_b_hybrid_hits_after_a_and_b(
    example_b: tuple[Both, list[int], list[bytes], list[bytes]],
) -> None:
    w, a, _, _ = example_b
    rng = random.Random(2)
    assert w.per_group(a) == [96, 96, 96] and w.hit(a) == 96
    assert w.hit([*a, 1, 2, 3]) == 96
    shares64 = a[:64] + _tokens(rng, 36, 9000)
    assert w.per_group(shares64) == [64, 64, 64] and w.hit(shares64) == 64  # B's junction
    shares40 = a[:40] + _tokens(rng, 60, 9000)
    assert w.per_group(shares40) == [32, 0, 0] and w.hit(shares40) == 0
    assert w.hit(_tokens(rng, 100, 20000)) == 0


def test_b_eviction_keeps_duplicate_copies_and_exact_states(
    example_b: tuple[Both, list[int], list[bytes], list[bytes]],
) -> None:
    """C (200 unrelated tokens) evicts A's copies of h0-h3 (B's copies stay), A's FA
    h4/h5 and A's Mamba state: A again hits 64 / 96 / 64 per group, so 64."""
    w, a, ha, _ = example_b
    c = _tokens(random.Random(3), 200, 30000)
    hc = engine_hashes(c)
    # §1.3: evictions made while allocating come before the step's stores, one hash each
    evictions = [remove(FA, [h]) for h in ha[:6]] + [remove(MB, [ha[5]])]
    w.send(
        *evictions,
        store(FA, hc[:12], c[:192], 16, FULL),
        store(SW, hc[10:12], c[:192], 16, SWA, window=32),
        store(MB, hc[11:12], c[:192], 16, MAMBA),
    )
    assert w.per_group(a) == [64, 96, 64]
    assert w.hit(a) == 64
    # B's copies go too: nothing of A's prefix is left in full attention
    w.send(*[remove(FA, [h]) for h in ha[:4]])
    assert w.per_group(a) == [0, 96, 64] and w.hit(a) == 0


def test_c_mamba_partial_checkpoint() -> None:
    """C. As B but Mamba block 64: hash unit 16 and partial hits on, so alignment 16.
    A's chunks are [0, 64), [64, 96), [96, 100); Mamba stores a full 64-token block at
    64 and a partial entry (block_size 16, one hash) at 96 (§5.4). A again hits 96."""
    a = _tokens(random.Random(4), 100, 1000)
    h = engine_hashes(a)
    w = Both()
    w.send(
        store(FA, h[:4], a[:64], 16, FULL),
        store(SW, [], a[:64], 16, SWA, window=32),  # no tail kept at 64: an empty store
        store(MB, h[3:4], a[:64], 64, MAMBA),  # one 64-token block: dense
    )
    w.send(
        store(FA, h[4:6], a[64:96], 16, FULL, parent=h[3]),
        store(SW, h[4:6], a[64:96], 16, SWA, window=32, parent=h[3]),
        # partial entry: one hash, parent one hash unit earlier, the last 16 tokens
        store(MB, h[5:6], a[80:96], 16, MAMBA, parent=h[4]),
    )
    assert w.cache.layout().alignment == 16
    assert w.per_group(a) == [96, 96, 96]
    assert w.hit(a) == 96
    # at 64 Mamba has its block state but the window has no blocks ending there
    assert w.per_group(a[:65]) == [64, 0, 64] and w.hit(a[:65]) == 0
    # below 96 the partial entry does not help: Mamba needs a state exactly at p
    assert w.per_group(a[:90]) == [80, 0, 64] and w.hit(a[:90]) == 0


def test_c_alignment_without_partial_hits_is_the_lcm() -> None:
    """Without a Mamba group there are no partial hits: the alignment is the LCM of the
    block sizes."""
    w = Both()
    w.send(store(FA, [], [], 64, FULL), store(SW, [], [], 16, SWA, window=32))
    assert w.cache.layout().alignment == 64


@pytest.mark.parametrize(("dense", "expected"), [(False, 96), (True, 128)])
def test_d_decode_under_default_and_dense_retention(dense: bool, expected: int) -> None:
    """D. 100-token prompt plus 40 generated tokens, then the 140-token continuation:
    96 under default retention (SWA and Mamba emit empty stores for decode blocks), 128
    with dense retention."""
    rng = random.Random(5)
    prompt = _tokens(rng, 100, 1000)
    full = prompt + _tokens(rng, 40, 7000)
    h = engine_hashes(full)
    w = Both()
    if dense:
        w.send(
            store(FA, h[:6], full[:96], 16, FULL),
            store(SW, h[:6], full[:96], 16, SWA, window=32),
            store(MB, h[5:6], full[:96], 16, MAMBA),
        )
    else:
        w.send(
            store(FA, h[:6], full[:96], 16, FULL),
            store(SW, h[4:6], full[:96], 16, SWA, window=32),
            store(MB, h[5:6], full[:96], 16, MAMBA),
        )
    for i in (6, 7):  # decode fills blocks 6 (tokens 96-112) and 7 (112-128)
        span = full[i * 16 : (i + 1) * 16]
        sparse = [h[i]] if dense else []
        w.send(
            store(FA, [h[i]], span, 16, FULL, parent=h[i - 1]),
            store(SW, sparse, span, 16, SWA, window=32, parent=h[i - 1]),
            store(MB, sparse, span, 16, MAMBA, parent=h[i - 1]),
        )
    assert w.per_group(full) == ([128, 128, 128] if dense else [128, 96, 96])
    assert w.hit(full) == expected
