"""SimCache reproduces the worked examples of reference §7.6 (observed on vLLM 0.33)."""

from __future__ import annotations

from sim_testkit import FA16, MAMBA16, MAMBA64, SWA32, Driver, hashes

from kvroute.sim.cache_api import CacheSpec
from kvroute.sim.events import BlockRemoved, BlockStored

A = list(range(1000, 1100))  # 100 tokens
B = A[:64] + list(range(2000, 2036))  # shares A's first 64 tokens, then differs
C = list(range(3000, 3200))  # 200 unrelated tokens
H = hashes(A)  # h0..h5 are A's hashes at 16, 32, ..., 96


def _stores(events: list, group: int) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored) and e.group_idx == group]


def test_a_full_attention_cap_and_alignment() -> None:
    d = Driver(CacheSpec(groups=(FA16,), num_blocks=64))
    prompt = A[:96]
    d.run("a", prompt)
    assert d.probe(prompt) == ([80], 80)  # cap 95, aligned down to 80
    assert d.run("again", prompt).hit == 80


def _example_b(num_blocks: int) -> tuple[Driver, list, list]:
    d = Driver(CacheSpec(groups=(FA16, SWA32, MAMBA16), num_blocks=num_blocks))
    ra = d.run("A", A, max_tokens=2)
    rb = d.run("B", B, max_tokens=2)
    return d, ra.events, rb.events


def test_b_hybrid_stores_are_sparse_and_per_group() -> None:
    _, a_events, b_events = _example_b(64)
    first = [e for e in a_events if isinstance(e, BlockStored)][:3]
    fa, swa, mamba = first
    assert (fa.group_idx, fa.block_hashes, fa.parent_block_hash) == (0, H[:6], None)
    assert fa.token_ids == A[:96] and fa.block_size == 16
    assert (swa.group_idx, swa.block_hashes, len(swa.token_ids)) == (1, H[4:6], 96)
    assert (mamba.group_idx, mamba.block_hashes, len(mamba.token_ids)) == (2, H[5:6], 96)
    assert fa.kv_cache_spec_kind == "full_attention"
    assert (swa.kv_cache_spec_kind, swa.kv_cache_spec_sliding_window) == ("sliding_window", 32)
    assert mamba.kv_cache_spec_kind == "mamba" and mamba.kv_cache_spec_sliding_window is None
    assert fa.extra_keys == [None] * 6
    # B's first step recomputes the shared 64 tokens (the joint hit was 0) and saves
    # sliding-window and Mamba state at its junction: duplicate full-attention stores.
    fa_b, swa_b, mamba_b = [e for e in b_events if isinstance(e, BlockStored)][:3]
    assert (fa_b.block_hashes, fa_b.parent_block_hash, len(fa_b.token_ids)) == (H[:4], None, 64)
    assert (swa_b.block_hashes, mamba_b.block_hashes) == (H[2:4], H[3:4])


def test_b_hits_after_a_and_b() -> None:
    d, _, _ = _example_b(64)
    other = list(range(4000, 4100))
    assert d.probe(A) == ([96, 96, 96], 96)
    assert d.probe([*A, 7, 8, 9]) == ([96, 96, 96], 96)
    assert d.probe(A[:64] + other[:36]) == ([64, 64, 64], 64)  # B's junction
    assert d.probe(A[:40] + other[:60]) == ([32, 0, 0], 0)
    assert d.probe(other) == ([0, 0, 0], 0)


def test_b_eviction_keeps_duplicate_copies_and_exact_mamba_state() -> None:
    d, _, _ = _example_b(40)
    rc = d.run("C", C, max_tokens=2)
    removed = [(e.group_idx, e.block_hashes) for e in rc.events if isinstance(e, BlockRemoved)]
    # One hash per BlockRemoved; LRU order: A's tail first (freed tail-first), then its head.
    assert removed == [(2, [H[5]])] + [(0, [h]) for h in reversed(H[:6])]
    keys = d.cache.coord.pool.cached_keys()
    by_hash = {(int.from_bytes(dig[-8:]), gid): n for (dig, gid), n in keys.items()}
    for h in H[:4]:  # A's copies of h0..h3 are gone, but B's duplicates still serve 64 tokens
        assert by_hash.get((h, 0)) == 1
    assert (H[5], 1) in by_hash and (H[3], 1) in by_hash  # SWA: A's tail at 96, B's at 64
    assert (H[5], 2) not in by_hash and (H[3], 2) in by_hash  # Mamba: only B's state at 64
    assert d.probe(A) == ([64, 96, 64], 64)


def test_c_large_mamba_blocks_partial_entry_at_the_hash_unit() -> None:
    d = Driver(CacheSpec(groups=(FA16, SWA32, MAMBA64), num_blocks=64))
    assert d.cache.spec.scheduler_block_size == 64 and d.cache.spec.alignment == 16
    ra = d.run("A", A)
    assert ra.chunks == [(0, 64), (64, 96), (96, 100)]
    mamba = _stores(ra.events, 2)
    full = [e for e in mamba if e.block_size == 64 and e.block_hashes]
    partial = [e for e in mamba if e.block_size == 16]
    assert [e.block_hashes for e in full] == [[H[3]]]  # the 64-token state at 64
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in partial] == [
        ([H[5]], H[4], A[80:96])
    ]
    assert d.probe(A)[1] == 96
    assert d.run("again", A).hit == 96


def test_d_decode_blocks_and_retention() -> None:
    prompt = A
    for retention, per_group, hit in ((0, [128, 96, 96], 96), (None, [128, 128, 128], 128)):
        d = Driver(
            CacheSpec(groups=(FA16, SWA32, MAMBA16), num_blocks=128, retention_interval=retention)
        )
        d.run("A", prompt, max_tokens=40)
        cont = prompt + list(range(3001, 3041))  # the Driver samples 3001, 3002, ...
        assert d.probe(cont) == (per_group, hit), retention


def test_decode_blocks_give_empty_sparse_stores_under_default_retention() -> None:
    d = Driver(CacheSpec(groups=(FA16, SWA32, MAMBA16), num_blocks=128))
    run = d.run("A", A, max_tokens=40)
    late = [e for b in run.batches[1:] for e in b if isinstance(e, BlockStored)]
    assert any(e.group_idx == 0 and e.block_hashes for e in late)  # dense full attention
    sparse = [e for e in late if e.group_idx in (1, 2)]
    assert sparse and all(e.block_hashes == [] and e.extra_keys is None for e in sparse)


def test_cache_salt_and_lora_are_in_the_identity_and_published_untagged() -> None:
    d = Driver(CacheSpec(groups=(FA16,), num_blocks=64))
    run = d.run("s", A, cache_salt="tenant-1", lora_name="ad", lora_id=3, lora_path="/x")
    stored = run.events[0]
    assert isinstance(stored, BlockStored)
    assert stored.lora_name == "ad" and stored.lora_id == 3
    assert stored.extra_keys is not None
    assert stored.extra_keys[0] == ("ad", "tenant-1")  # salt only on the first block
    assert stored.extra_keys[1:] == [("ad",)] * 5
    assert stored.block_hashes != H[:6]
    assert d.probe(A) == ([0], 0)  # other namespace: no hit
    assert d.probe(A, cache_salt="tenant-1", lora_name="ad", lora_path="/x")[1] == 96
    assert d.probe(A, cache_salt="tenant-1", lora_name="ad", lora_path="/y")[1] == 0
