"""Speculative expectations: credit before the events arrive, expiry, confirmation."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.indexer import FleetIndex, Namespace, content_keys
from tests.indexer.events import FULL, MAMBA, SWA, batch, engine_hashes, store

RNG = random.Random(11)
P = [RNG.randrange(1000, 9000) for _ in range(200)]
H = engine_hashes(P)


def _fleet() -> FleetIndex:
    fi = FleetIndex()
    fi.apply("full", batch(0, store(0, [], [], 16, FULL)))
    fi.apply(
        "hybrid",
        batch(
            0,
            store(0, [], [], 16, FULL),
            store(1, [], [], 16, SWA, window=32),
            store(2, [], [], 16, MAMBA),
        ),
    )
    return fi


def test_full_attention_worker_is_credited_with_the_common_prefix() -> None:
    fi = _fleet()
    fi.expect("full", P[:100], None, expires_at=10.0)
    assert fi.score(P[:100])["full"] == 96  # what a resend would reuse
    assert fi.score(P[:70] + [1] * 30)["full"] == 64  # a shared 70-token prefix
    assert fi.score(P[:100], Namespace(cache_salt="x"))["full"] == 0  # other namespace
    assert fi.score(P[:100])["hybrid"] == 0
    ws = fi.explain(P[:100])["full"]
    assert ws.expected_tokens == 96 and "speculative" in ws.reason


def test_hybrid_worker_is_credited_only_at_the_replay_boundary() -> None:
    fi = _fleet()
    fi.expect("hybrid", P[:100], None, expires_at=10.0)
    assert fi.score(P[:100])["hybrid"] == 96
    assert fi.score(P[:120])["hybrid"] == 96
    # a request sharing 70 tokens: Mamba/SWA state exists only at 96: no credit
    assert fi.score(P[:70] + [1] * 30)["hybrid"] == 0


def test_hybrid_coverage_includes_the_expected_prefix() -> None:
    """A sibling sharing 70 tokens of an expected prompt reuses nothing there yet, but the
    hybrid worker's full attention will hold those tokens: reach_keys reports them."""
    fi = _fleet()
    fi.expect("hybrid", P[:100], None, expires_at=10.0)
    sibling = P[:70] + [1] * 30
    scores, coverage = fi.reach_keys(fi_keys(fi, sibling), len(sibling))
    assert scores == {"full": 0, "hybrid": 0}
    assert coverage == {"hybrid": 64}  # 4 whole hash units shared; "full" is absent
    # events (which confirm the expectation): full attention holds 96 tokens, the sliding
    # window and Mamba groups nothing, so 0 is reusable and 96 covered
    fi.apply("hybrid", batch(1, store(0, H[:6], P[:96], 16, FULL)))
    scores, coverage = fi.reach_keys(fi_keys(fi, P[:120]), 120)
    assert scores["hybrid"] == 0 and coverage == {"hybrid": 96}


def fi_keys(fi: FleetIndex, ids: list[int]) -> list[int]:
    return content_keys(ids, None, fi.hash_unit)


def test_unknown_worker_gets_a_score_from_an_expectation() -> None:
    fi = FleetIndex()
    fi.expect("new", P[:100], None, expires_at=5.0)
    assert fi.score(P[:100]) == {"new": 96}
    fi.expire(5.0)
    assert fi.score(P[:100]) == {"new": None}


def test_expectations_expire_and_events_confirm_them() -> None:
    fi = _fleet()
    fi.expect("full", P[:100], None, expires_at=10.0)
    fi.expect("full", P[:50], None, expires_at=20.0)
    fi.expire(10.0)
    assert fi.score(P[:100])["full"] == 48  # only the second is live
    # the worker's events report the block at the second prompt's replay boundary
    fi.apply("full", batch(1, store(0, H[:3], P[:48], 16, FULL)))
    assert fi.score(P[:100])["full"] == 48  # from the events now
    assert fi.stats("full").expectations == 0  # confirmed and dropped


def test_expectation_never_lowers_an_event_based_score() -> None:
    fi = _fleet()
    fi.apply("full", batch(1, store(0, H[:6], P[:96], 16, FULL)))
    fi.expect("full", P[:40], None, expires_at=1.0)
    assert fi.score(P[:100])["full"] == 96


def test_expectations_are_bounded_per_worker() -> None:
    fi = FleetIndex(max_expectations_per_worker=4)
    for i in range(10):
        fi.expect("w", [i] * 64, None, expires_at=float(i))
    assert fi.stats("w").expectations == 4
    assert fi.score([9] * 64)["w"] == 48
    assert fi.score([0] * 64)["w"] is None  # the earliest-expiring were dropped


def test_hybrid_worker_is_credited_at_the_junction_it_will_save() -> None:
    """Routed for its junction (full attention held 64 tokens beyond the reuse), the prompt
    makes vLLM save state at 64 as well: a sibling sharing 70 tokens is credited 64."""
    fi = _fleet()
    keys = fi_keys(fi, P[:100])
    fi.expect_keys("hybrid", keys, 100, expires_at=10.0, junction=64)
    sibling = P[:70] + [1] * 30
    assert fi.score(sibling)["hybrid"] == 64
    assert fi.score(P[:100])["hybrid"] == 96  # the replay boundary as before
    # a junction beyond the replay boundary adds nothing
    fi2 = _fleet()
    fi2.expect_keys("hybrid", keys, 100, expires_at=10.0, junction=128)
    assert fi2.score(sibling)["hybrid"] == 0


def test_a_worker_of_unknown_layout_has_no_coverage_from_an_expectation() -> None:
    """A worker with no events yet (just started or restarted) may be dense: there a
    sibling sharing 64 tokens of the expected prompt reuses all 64 at once, so those tokens
    are no junction to invest in. Its coverage is unknown, hence absent (as for a worker
    whose events show only full attention), and the credit stays the conservative 0.

    Regression: the expectation's reach was reported as coverage for such a worker, so the
    junction-crediting policy sent the sibling there predicted 0, and the dense engine
    served 752 cached tokens (tests/reliability: test_engine_restarted_gives_no_stale_hits).
    """
    fi = FleetIndex()
    fi.expect("new", P[:100], None, expires_at=10.0)
    sibling = P[:70] + [1] * 30
    scores, coverage = fi.reach_keys(fi_keys(fi, sibling), len(sibling))
    assert scores == {"new": None} and coverage == {}
    # its events show full attention only: the sibling is credited the shared prefix
    fi.apply("new", batch(0, store(0, [], [], 16, FULL)))
    scores, coverage = fi.reach_keys(fi_keys(fi, sibling), len(sibling))
    assert scores == {"new": 64} and coverage == {}


def test_a_worker_without_events_is_judged_by_the_layout_its_peers_share() -> None:
    """A worker that has reported no group yet (idle since the router started, or just
    added) serves the model its peers serve: a prompt expected there is judged by their
    shared layout. On a hybrid fleet its full attention will hold the prompt, so a sibling
    sharing 70 tokens finds 64 tokens of coverage there (a junction to invest in), and
    reuses nothing yet; on a dense fleet the sibling reuses the 64 at once. Peers of
    different layouts lend nothing, and the worker's own first event replaces the loan."""
    sibling = P[:70] + [1] * 30
    peers = FleetIndex()  # peers: hybrid only
    peers.apply("hybrid", batch(0, store(0, [], [], 16, FULL), store(1, [], [], 16, MAMBA)))
    peers.expect("new", P[:100], None, expires_at=10.0)
    scores, coverage = peers.reach_keys(fi_keys(peers, sibling), len(sibling))
    assert coverage.get("new") == 64 and not scores["new"]
    assert peers.score(P[:100])["new"] == 96  # the prompt's own end: its replay boundary
    dense = FleetIndex()
    dense.apply("full", batch(0, store(0, [], [], 16, FULL)))
    dense.expect("new", P[:100], None, expires_at=10.0)
    scores, coverage = dense.reach_keys(fi_keys(dense, sibling), len(sibling))
    assert scores["new"] == 64 and "new" not in coverage
    # peers disagree (dense and hybrid): the new worker stays unknown, credited cautiously
    hybrid = _fleet()
    hybrid.expect("new", P[:100], None, expires_at=10.0)
    scores, coverage = hybrid.reach_keys(fi_keys(hybrid, sibling), len(sibling))
    assert "new" not in coverage and not scores["new"]
    # its own events show full attention only: that is what judges it from now on
    peers.apply("new", batch(0, store(0, [], [], 16, FULL)))
    scores, coverage = peers.reach_keys(fi_keys(peers, sibling), len(sibling))
    assert scores["new"] == 64 and "new" not in coverage


def test_a_junction_is_credited_where_each_sparse_group_keeps_its_state() -> None:
    """vLLM keeps a Mamba group's junction state in the Mamba block ending at or before
    the junction (`MambaManager.reachable_block_mask`: block `aligned // block_size - 1`;
    a partial checkpoint exactly at the junction needs
    `enable_mamba_shared_prefix_checkpoint`). With Mamba blocks of 64 tokens (hits aligned
    to 16), a junction at 80 leaves state at 64: a sibling sharing those 80 tokens hits 64,
    as vLLM 0.33's own KVCacheManager answers (80 -> 64, 96 -> 64, 144 -> 128). A sliding
    window keeps its tail ending at the junction itself."""
    mamba64 = FleetIndex()
    mamba64.apply("m", batch(0, store(0, [], [], 16, FULL), store(1, [], [], 64, MAMBA)))
    assert mamba64.layout("m").alignment == 16
    keys = fi_keys(mamba64, P[:200])
    for junction, credited in ((80, 64), (96, 64), (64, 64), (144, 128), (48, 0)):
        mamba64.expect_keys("m", keys, 200, expires_at=10.0, junction=junction)
        sibling = P[:junction] + [1] * 30  # shares exactly the junction's tokens
        assert mamba64.score(sibling)["m"] == credited, junction
        mamba64.expire(10.0)
    swa = _fleet()  # FA + SWA + Mamba, all block 16: every group keeps state at 80
    swa.expect_keys("hybrid", keys, 200, expires_at=10.0, junction=80)
    assert swa.score(P[:90] + [1] * 30)["hybrid"] == 80


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_coverage_only_for_workers_whose_events_show_junctions(seed: int) -> None:
    """Whatever is expected where: `reach_keys` reports coverage only for workers whose
    events show full attention beside sparse groups, never below their score."""
    rng = random.Random(seed)
    fi = FleetIndex()
    fi.apply("dense", batch(0, store(0, [], [], 16, FULL)))
    fi.apply("swa_only", batch(0, store(0, [], [], 16, SWA, window=32)))
    fi.apply(
        "hybrid",
        batch(0, store(0, [], [], 16, FULL), store(1, [], [], 64, MAMBA)),
    )
    fi.expect("unknown", [1] * 16, None, expires_at=0.5)  # known to the index, no layout
    fi.expire(1.0)
    docs = [[rng.randrange(3) for _ in range(rng.randrange(16, 300))] for _ in range(3)]

    def prompt() -> list[int]:
        doc = rng.choice(docs)
        return doc[: rng.randrange(1, len(doc) + 1)] + [9] * rng.randrange(0, 40)

    names = ["dense", "swa_only", "hybrid", "unknown"]
    for _ in range(rng.randrange(1, 12)):
        ids = prompt()
        junction = rng.randrange(0, len(ids) + 1)
        fi.expect_keys(rng.choice(names), fi_keys(fi, ids), len(ids), 10.0, junction)
    for _ in range(10):
        ids = prompt()
        scores, coverage = fi.reach_keys(fi_keys(fi, ids), len(ids))
        assert set(coverage) <= {"hybrid"}, coverage
        for name, covered in coverage.items():
            assert (scores[name] or 0) <= covered
