"""The paired cluster bootstrap behind benchmark 1's "is this TTFT gap real" intervals."""

from __future__ import annotations

import random

import pytest

from kvroute.testbed.stats import paired_bootstrap, paired_bootstrap_mean


def _sessions(n: int, seed: int, shift: float, noise: float, spread: float) -> list:
    """n sessions of 3 turns; a session's level varies by `spread`, a turn by `noise`; the
    first router's turns are the second's plus `shift` plus their own noise."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        level = rng.uniform(0.05, 0.05 + spread)
        b = [level + rng.gauss(0, noise) for _ in range(3)]
        a = [x + shift + rng.gauss(0, noise) for x in b]
        out.append((a, b))
    return out


def test_a_constant_shift_is_found_exactly() -> None:
    clusters = [([t - 0.01 for t in b], b) for _, b in _sessions(50, 1, 0.0, 0.0, 0.2)]
    d = paired_bootstrap(clusters, 50)
    assert d is not None
    assert d.diff == pytest.approx(-0.01)
    assert d.low == pytest.approx(-0.01) and d.high == pytest.approx(-0.01)
    assert d.verdict == "lower"
    assert d.to_json()["verdict"] == "lower"


def test_equal_routers_are_not_distinguishable() -> None:
    # Same distribution, independent noise per request: the interval must straddle zero and
    # be about as wide as the noise makes the median uncertain.
    clusters = _sessions(80, 2, 0.0, 0.01, 0.2)
    d = paired_bootstrap(clusters, 50)
    assert d is not None and d.verdict == "not distinguishable"
    assert d.low < 0 < d.high and d.high - d.low < 0.05
    assert d.level == 0.95


def test_a_small_consistent_gap_shows_through_large_session_variance() -> None:
    # Sessions differ by up to 500 ms, the routers by 5 ms: pairing the sessions finds it.
    clusters = _sessions(100, 3, 0.005, 0.001, 0.5)
    d = paired_bootstrap(clusters, 50)
    assert d is not None and d.verdict == "higher"
    assert 0 < d.low <= d.diff <= d.high < 0.05
    # The same values with the second router's sessions shuffled (pairing broken): the gap
    # drowns in the session variance.
    rng = random.Random(4)
    seconds = [b for _, b in clusters]
    rng.shuffle(seconds)
    unpaired = paired_bootstrap([(a, b) for (a, _), b in zip(clusters, seconds, strict=True)], 50)
    assert unpaired is not None and unpaired.verdict == "not distinguishable"
    assert unpaired.high - unpaired.low > 4 * (d.high - d.low)


def test_noise_only_interval_covers_zero_and_is_repeatable() -> None:
    clusters = _sessions(60, 5, 0.0, 0.02, 0.1)
    d1 = paired_bootstrap(clusters, 99)
    d2 = paired_bootstrap(clusters, 99)
    assert d1 == d2  # seeded
    assert d1 is not None and d1.low <= 0 <= d1.high
    assert paired_bootstrap(clusters, 99, seed=1) != d1  # the seed is what makes it repeatable


def test_empty_sides_give_none_and_one_sided_sessions_still_count() -> None:
    assert paired_bootstrap([], 50) is None
    assert paired_bootstrap([([1.0], [])], 50) is None
    d = paired_bootstrap([([1.0], []), ([], [2.0]), ([3.0], [3.0])], 50, iterations=200)
    # first router's values [1, 3] (median 2), second's [2, 3] (median 2.5)
    assert d is not None and d.diff == pytest.approx(-0.5)
    assert d.low <= d.diff <= d.high


def test_the_mean_of_counts_with_a_reference_difference() -> None:
    """Blocks pulled per request: whole numbers, many zeros; the mean's difference is the
    plain difference of pooled means, and its interval finds a one-block gap per request."""
    rng = random.Random(6)
    clusters = []
    for _ in range(120):
        b = [float(rng.choice([0, 0, 20, 40, 60])) for _ in range(3)]
        clusters.append(([x + 1.0 if x else 1.0 for x in b], b))
    d = paired_bootstrap_mean(clusters)
    first = [x for a, _ in clusters for x in a]
    second = [x for _, b in clusters for x in b]
    assert d is not None
    assert d.diff == pytest.approx(sum(first) / len(first) - sum(second) / len(second))
    assert d.diff == pytest.approx(1.0) and d.verdict == "higher"
    assert d.low == pytest.approx(1.0) and d.high == pytest.approx(1.0)  # a constant gap
    mixed = [(a, b) for (a, _), (_, b) in zip(clusters, reversed(clusters), strict=True)]
    loose = paired_bootstrap_mean(mixed)
    assert loose is not None and loose.low < loose.diff < loose.high
    assert loose.high - loose.low > 2.0  # unpaired sessions: the gap drowns
    assert paired_bootstrap_mean([]) is None
