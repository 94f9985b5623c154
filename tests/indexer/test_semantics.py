"""Event semantics, one rule per test: ordering, resets, pending, copies, namespaces,
unmatchable blocks, layouts that cannot be modelled, caps."""

from __future__ import annotations

import random

import pytest

from kvroute.indexer import FleetIndex, GroupCache, Namespace, content_keys
from tests.indexer.events import (
    FULL,
    MAMBA,
    SWA,
    batch,
    clear,
    engine_hashes,
    invalid,
    remove,
    snapshot,
    store,
)

RNG = random.Random(7)
P = [RNG.randrange(1000, 9000) for _ in range(200)]  # a prompt
H = engine_hashes(P)  # its block hashes (block 16)


def full(hashes: list[bytes], start: int = 0, **kw: object) -> object:
    """A dense full-attention store of blocks start.. of P."""
    n = len(hashes)
    parent = H[start - 1] if start else b""
    return store(0, hashes, P[start * 16 : (start + n) * 16], 16, FULL, parent=parent, **kw)  # type: ignore[arg-type]


def hit(gc: GroupCache, tokens: list[int] = P[:97], ns: Namespace | None = None) -> int | None:
    return gc.reusable_tokens(tokens, ns)


# -- ordering and resets ------------------------------------------------------------------


def test_stale_and_repeated_batches_are_ignored() -> None:
    gc = GroupCache()
    gc.apply(batch(5, full(H[:6])))
    gc.apply(batch(5, remove(0, H[:6])))  # repeated sequence
    gc.apply(batch(3, remove(0, H[:6])))  # old sequence
    assert hit(gc) == 96
    assert gc.stats().stale == 2 and gc.stats().last_sequence == 5


def test_a_gap_discards_the_view_then_applies_the_batch() -> None:
    gc = GroupCache()
    gc.apply(batch(0, full(H[:6])))
    gc.apply(batch(2, store(0, [H[6]], P[96:112], 16, FULL, parent=H[5])))
    st = gc.stats()
    assert st.gaps == 1 and st.resets == 1
    # the old blocks are gone; the new one's parent is unknown: pending, never a root
    assert hit(gc, P[:120]) == 0 and st.pending == 1


def test_invalid_discards_the_view_and_the_rest_of_the_batch_applies() -> None:
    gc = GroupCache()
    gc.apply(batch(0, full(H[:6])))
    gc.apply(batch(1, invalid(), full(H[:2])))
    assert hit(gc) == 32
    assert gc.stats().invalid == 1 and gc.stats().resets == 1


def test_a_kind_change_discards_the_view_and_the_event_starts_a_new_one() -> None:
    gc = GroupCache()
    gc.apply(batch(0, full(H[:6])))
    gc.apply(batch(1, store(0, H[:2], P[:32], 16, SWA, window=32)))
    assert gc.stats().conflicts == 1
    assert gc.layout().groups[0].kind == SWA
    assert hit(gc) == 32  # a window run from token 0


def test_a_hash_at_two_positions_is_a_conflict() -> None:
    gc = GroupCache()
    gc.apply(batch(0, full(H[:6])))
    # H[5] claimed to end at 16
    gc.apply(batch(1, store(0, [H[5]], P[:16], 16, FULL)))
    assert gc.stats().conflicts == 1
    # the fresh view holds only what the conflicting event said: P[:16] (under H[5])
    assert hit(gc) == 16 and gc.stats().entries == 1


def test_clear_keeps_groups_so_the_answer_is_zero_not_none() -> None:
    gc = GroupCache()
    gc.apply(batch(0, full(H[:6]), store(1, [H[5]], P[:96], 16, MAMBA)))
    gc.apply(batch(1, clear()))
    assert hit(gc) == 0
    assert gc.stats().blocks_per_group == {0: 0, 1: 0} and gc.stats().entries == 0


def test_invalidate_means_no_score_until_new_evidence() -> None:
    gc = GroupCache()
    gc.apply(batch(0, full(H[:6])))
    gc.invalidate()
    assert hit(gc) is None
    gc.apply(batch(7, full(H[:3])))
    assert hit(gc) == 48


def test_snapshot_replaces_the_view_and_resumes_the_sequence() -> None:
    gc = GroupCache()
    gc.apply(batch(0, full(H[:6])))
    gc.apply_snapshot(snapshot([full(H[:2]), store(1, [], [], 16, MAMBA)], sequence=10))  # type: ignore[list-item]
    assert hit(gc) == 0  # Mamba declared but holds nothing
    assert gc.stats().last_sequence == 10 and gc.stats().resets == 0
    gc.apply(batch(11, store(1, [H[1]], P[:32], 16, MAMBA)))
    assert hit(gc) == 32 and gc.stats().gaps == 0
    gc.apply_snapshot(snapshot([]))  # an empty snapshot is a reset
    assert hit(gc) is None and gc.stats().last_sequence is None


def test_snapshot_lineage_places_blocks_without_holding_them() -> None:
    """A sliding-window tail whose prefix was evicted (the bridge's snapshot of it): the
    lineage places the tail, holds nothing, and is released after the snapshot."""
    swa = {"window": 64, "kind": SWA}
    tail = store(0, H[2:6], P[32:96], 16, parent=H[1], **swa)  # type: ignore[arg-type]
    lineage = [store(0, H[:2], P[:32], 16, **swa)]  # type: ignore[arg-type]
    live = GroupCache()
    live.apply(batch(0, store(0, H[:6], P[:96], 16, **swa)))  # type: ignore[arg-type]
    live.apply(batch(1, remove(0, H[:2])))
    assert hit(live) == 96
    without = GroupCache()
    without.apply_snapshot(snapshot([tail], sequence=1))
    assert hit(without) == 0  # the tail waits for a parent nothing places
    gc = GroupCache()
    gc.apply_snapshot(snapshot([tail], sequence=1, lineage=lineage))
    assert hit(gc) == 96
    stats = gc.stats()
    assert stats.blocks_per_group == {0: 4} and stats.entries == 4 and stats.pending == 0
    assert hit(gc, P[:40]) == 0  # [0, 32) is placed but not held: no window there
    # Lineage alone holds nothing and declares nothing: the worker has no groups.
    only = GroupCache()
    only.apply_snapshot(snapshot([], sequence=1, lineage=lineage))
    assert hit(only) is None and only.stats().entries == 0


def test_snapshot_lineage_that_contradicts_discards_the_view() -> None:
    gc = GroupCache()
    wrong = store(0, H[:2], P[16:48], 16)  # H[:2] at the same positions, other tokens
    gc.apply_snapshot(snapshot([full(H[:3])], sequence=1, lineage=[full(H[:2]), wrong]))  # type: ignore[list-item]
    # As for events: each contradiction restarts the view with the contradicting report
    # (the wrong lineage, then the event that contradicts it); the events rebuild it.
    assert gc.stats().conflicts == 2
    assert hit(gc) == 48


def test_snapshot_copies_are_counted() -> None:
    gc = GroupCache()
    gc.apply_snapshot(snapshot([full(H[:2]), full(H[:2])], sequence=1))  # type: ignore[list-item]
    gc.apply(batch(2, remove(0, H[:2])))
    assert hit(gc) == 32  # the second copy still holds


# -- history, pending, copies ---------------------------------------------------------------


def test_history_is_released_only_at_the_end_of_the_batch() -> None:
    gc = GroupCache()
    gc.apply(batch(0, full(H[:3])))
    # removal of the parent and store of its child in the same batch: the child resolves
    gc.apply(batch(1, remove(0, [H[2]]), full([H[3]], 3), full([H[2]], 2)))
    assert hit(gc) == 64
    # across batches the parent's position is gone: the child waits (not credited)
    gc2 = GroupCache()
    gc2.apply(batch(0, full(H[:3])))
    gc2.apply(batch(1, remove(0, [H[2]])))
    gc2.apply(batch(2, full([H[3]], 3)))
    assert hit(gc2) == 32 and gc2.stats().pending == 1


def test_unknown_parents_wait_and_resolve_in_cascade() -> None:
    gc = GroupCache()
    gc.apply(batch(0, full([H[4]], 4), full(H[2:4], 2)))  # grandchildren first
    assert hit(gc) == 0 and gc.stats().pending == 3
    gc.apply(batch(1, full(H[:2])))
    assert hit(gc) == 80 and gc.stats().pending == 0


def test_sparse_reports_wait_for_a_dense_report_of_the_same_hash() -> None:
    gc = GroupCache()
    # Mamba first (sparse: one hash for 96 tokens), full attention a batch later
    gc.apply(batch(0, store(1, [H[5]], P[:96], 16, MAMBA), store(0, [], [], 16, FULL)))
    assert hit(gc) == 0 and gc.stats().pending == 1
    gc.apply(batch(1, full(H[:6])))
    assert hit(gc) == 96 and gc.stats().pending == 0


def test_sparse_reports_are_never_sliced_by_ordinal() -> None:
    gc = GroupCache()
    # two hashes for a 96-token span: whatever their order, no position is guessed
    gc.apply(batch(0, store(0, [H[4], H[5]], P[:96], 16, SWA, window=32)))
    assert hit(gc) == 0 and gc.stats().entries == 0


def test_copies_are_counted_per_group_and_hash() -> None:
    gc = GroupCache()
    gc.apply(batch(0, full(H[:6]), full(H[:6])))
    gc.apply(batch(1, *[remove(0, [h]) for h in H[:6]]))
    assert hit(gc) == 96
    gc.apply(batch(2, remove(0, [H[3]])))
    assert hit(gc) == 48


def test_a_participating_group_that_holds_nothing_forces_zero() -> None:
    gc = GroupCache()
    gc.apply(batch(0, full(H[:6]), store(1, [], P[:96], 16, MAMBA)))  # empty store
    assert hit(gc) == 0
    gc.apply(batch(1, store(1, [H[3]], P[:96], 16, MAMBA)))
    assert hit(gc) == 64


def test_partial_entries_count_at_their_exact_position() -> None:
    gc = GroupCache()
    fine = engine_hashes(P)
    gc.apply(
        batch(
            0,
            full(H[:6]),
            store(1, [fine[3]], P[:64], 64, MAMBA),
            store(1, [fine[4]], P[64:80], 16, MAMBA, parent=fine[3]),  # partial at 80
        )
    )
    assert gc.layout().alignment == 16  # Mamba 64 > unit 16: partial hits on
    assert gc.layout().groups[1].block_size == 64  # the largest block size seen
    assert hit(gc, P[:90]) == 80
    assert hit(gc, P[:81]) == 80
    assert hit(gc, P[:80]) == 64


# -- namespaces and unmatchable blocks --------------------------------------------------------


def test_salt_is_published_at_token_0_and_inherited_by_children() -> None:
    salted = engine_hashes(P, salt="s")
    gc = GroupCache()
    gc.apply(batch(0, store(0, salted[:2], P[:32], 16, FULL, salt="s")))
    gc.apply(batch(1, store(0, salted[2:6], P[32:96], 16, FULL, parent=salted[1])))
    assert hit(gc, P[:97], Namespace(cache_salt="s")) == 96
    assert hit(gc, P[:97]) == 0
    assert hit(gc, P[:97], Namespace(cache_salt="t")) == 0


def test_lora_blocks_match_only_lora_requests() -> None:
    lh = engine_hashes(P, lora="ad")
    gc = GroupCache()
    gc.apply(batch(0, store(0, lh[:2], P[:32], 16, FULL, lora="ad")))
    gc.apply(batch(1, store(0, lh[2:6], P[32:96], 16, FULL, parent=lh[1], lora="ad")))
    assert hit(gc, P[:97], Namespace(lora_name="ad")) == 96
    assert hit(gc, P[:97]) == 0


def test_a_child_naming_another_namespace_than_its_parent_never_matches() -> None:
    gc = GroupCache()
    gc.apply(batch(0, full(H[:2]), full(H[2:4], 2, lora="other")))
    assert hit(gc) == 32
    assert hit(gc, P[:97], Namespace(lora_name="other")) == 0


def test_unmatchable_blocks_keep_lineage_but_never_match() -> None:
    gc = GroupCache()
    gc.apply(batch(0, full(H[:2], unmatchable=True), full(H[2:4], 2)))
    assert hit(gc) == 0  # the children of an unmatchable block are unmatchable too
    assert gc.stats().entries == 4 and gc.stats().pending == 0
    gc.apply(batch(1, full(H[:2])))  # a matchable report of the same blocks
    assert hit(gc) == 32


def test_a_known_matchable_block_continues_the_chain_in_a_lineage_only_event() -> None:
    gc = GroupCache()
    gc.apply(batch(0, full(H[:4])))
    # X: a lineage-only block at 16 (say, an image); a store after it names H[1]..H[5]:
    # H[1] is known matchable, so the blocks after it are keyed from H[1]'s content
    x = b"image-01"
    gc.apply(
        batch(
            1,
            store(0, [x], P[:16], 16, FULL, unmatchable=True),
            store(0, H[1:6], P[16:96], 16, FULL, parent=x),
        )
    )
    assert hit(gc) == 96


def test_two_hashes_for_the_same_content_only_lower_the_score() -> None:
    """Aliases (a LoRA path re-pointed under the same name): presence is counted per
    content, so a removal of either lowers the answer, never raises it."""
    gc = GroupCache()
    gc.apply(batch(0, full(H[:2])))
    alias = [b"alias-00", b"alias-01"]
    gc.apply(batch(1, store(0, alias, P[:32], 16, FULL)))
    gc.apply(batch(2, remove(0, [H[1]])))
    assert hit(gc) in (16, 32)


# -- layouts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "window", "reason"),
    [
        ("chunked_local_attention", 0, "not modelled"),
        ("unknown", 0, "not modelled"),
        ("", 0, "no kind"),
        ("cross_attention", 0, "not modelled"),
        (SWA, 0, "without a window"),
    ],
)
def test_kinds_that_cannot_be_modelled_give_none(kind: str, window: int, reason: str) -> None:
    gc = GroupCache()
    gc.apply(batch(0, full(H[:6]), store(1, [], [], 16, kind, window=window)))
    assert hit(gc) is None
    explained = gc.explain(P[:97])
    assert reason in explained.reason and explained.groups[1].accepted_tokens is None
    assert gc.stats().valid is False


def test_block_sizes_the_hash_unit_cannot_express_give_none() -> None:
    gc = GroupCache()
    gc.apply(batch(0, store(0, [H[0]], P[:8], 8, FULL)))
    assert hit(gc) is None and "hash unit" in gc.explain(P).reason


def test_no_groups_means_none() -> None:
    gc = GroupCache()
    assert hit(gc) is None
    gc.apply(batch(0, remove(0, H[:1])))
    assert hit(gc) is None


def test_alignment_override() -> None:
    gc = GroupCache()
    gc.apply(batch(0, full(H[:6])))
    gc.set_alignment(64)
    assert hit(gc) == 64 and gc.layout().alignment == 64
    gc.set_alignment(None)
    assert hit(gc) == 96
    with pytest.raises(ValueError):
        gc.set_alignment(24)


def test_malformed_events_discard_the_view() -> None:
    gc = GroupCache()
    gc.apply(batch(0, full(H[:6])))
    gc.apply(batch(1, store(0, [H[0]], P[:16], 0, FULL)))  # no block size
    assert hit(gc) is None and gc.stats().malformed == 1
    gc.apply(batch(2, full(H[:6]), store(0, [b""], P[:16], 16, FULL)))  # empty hash
    assert hit(gc) is None and gc.stats().malformed == 2


def test_request_tokens_must_be_uint32() -> None:
    with pytest.raises(ValueError):
        content_keys([1, -2, 3] * 16)
    with pytest.raises(ValueError):
        content_keys([2**32] * 16)


# -- bounded memory --------------------------------------------------------------------------


def test_entry_cap_evicts_deepest_first_with_a_counted_lower_score() -> None:
    gc = GroupCache(max_entries=9)
    other = [RNG.randrange(1000, 9000) for _ in range(160)]
    oh = engine_hashes(other)
    gc.apply(batch(0, full(H[:4])))
    gc.apply(batch(1, store(0, oh[:10], other, 16, FULL)))
    st = gc.stats()
    assert st.entries <= 9 and st.evicted == 6  # down to 7/8 of the cap
    assert hit(gc, P[:97]) == 64  # the shallow prompt survived
    deep = hit(gc, [*other, 1])
    assert deep is not None and deep < 160  # lower, and never more than the truth


def test_pending_is_bounded() -> None:
    gc = GroupCache(max_pending=16)
    orphans = [store(0, [bytes([i]) * 8], P[:16], 16, FULL, parent=b"nope") for i in range(1, 40)]
    gc.apply(batch(0, *orphans))
    st = gc.stats()
    assert st.pending <= 16 and st.pending_evicted >= 23


# -- fleet -----------------------------------------------------------------------------------


def test_fleet_scores_every_known_worker_and_forgets_removed_ones() -> None:
    fi = FleetIndex()
    fi.apply("a", batch(0, full(H[:6])))
    fi.apply("b", batch(0, full(H[:2]), store(1, [], [], 16, MAMBA)))
    fi.apply("c", batch(0, store(0, [], [], 16, "unknown")))
    assert fi.score(P[:97]) == {"a": 96, "b": 0, "c": None}
    fi.remove_worker("a")
    assert fi.score(P[:97]) == {"b": 0, "c": None}
    fi.apply("d", batch(0, full(H[:3])))  # reuses a's index; a's bits are gone
    assert fi.score(P[:97]) == {"b": 0, "c": None, "d": 48}
    assert sorted(fi.workers()) == ["b", "c", "d"]
    with pytest.raises(KeyError):
        fi.stats("a")


def test_fleet_workers_with_different_layouts() -> None:
    fi = FleetIndex()
    fi.apply("full", batch(0, full(H[:6])))
    fi.apply(
        "hybrid",
        batch(
            0,
            full(H[:6]),
            store(1, H[2:6], P[:96], 16, SWA, window=32),
            store(2, [H[3]], P[:64], 16, MAMBA),
        ),
    )
    fi.apply("wide", batch(0, store(0, [H[1], H[3], H[5]], P[:96], 32, FULL)))
    assert fi.score(P[:97]) == {"full": 96, "hybrid": 64, "wide": 96}
    assert fi.score(P[:70]) == {"full": 64, "hybrid": 64, "wide": 64}


def test_shared_holder_sets_are_released() -> None:
    fi = FleetIndex()
    for name in ("a", "b", "c"):
        fi.apply(name, batch(0, full(H[:6])))
    assert fi._inv.shared_bitsets() == 1  # one {a, b, c} object for all six keys
    fi.apply("b", batch(1, *[remove(0, [h]) for h in H[:3]]))
    assert fi._inv.shared_bitsets() == 2  # {a, c} for three keys, {a, b, c} for three
    fi.remove_worker("c")
    fi.remove_worker("b")
    assert fi._inv.shared_bitsets() == 0
    assert fi.score(P[:97]) == {"a": 96}
