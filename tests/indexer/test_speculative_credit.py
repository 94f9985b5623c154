"""`Expectations.credit` (bisecting the common prefix) against a brute-force reference."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.indexer.keys import content_keys
from kvroute.indexer.speculative import Expectations

UNIT = 16


def brute_reach(exps: Expectations, keys: list[int], cap: int) -> dict[int, int]:
    """Per worker: the longest common prefix (in units) with any of its expectations."""
    m = min(len(keys), cap // UNIT)
    out: dict[int, int] = {}
    for index, mine in exps._by_worker.items():
        reach = 0
        for exp in mine.values():
            n = 0
            while n < m and n < len(exp.keys) and exp.keys[n] == keys[n]:
                n += 1
            reach = max(reach, n)
        if reach:
            out[index] = reach
    return out


def brute_force(
    exps: Expectations, keys: list[int], cap: int, rules: dict[int, tuple[bool, int]]
) -> dict[int, int]:
    """Per worker: the longest common prefix with any of its expectations; credit that
    (aligned) on full-attention workers, else the furthest replay boundary inside it."""
    out: dict[int, int] = {}
    for index, reach in brute_reach(exps, keys, cap).items():
        mine = exps._by_worker[index]
        full_only, alignment = rules[index]
        if full_only:
            credit = reach * UNIT - (reach * UNIT) % alignment
        else:
            credit = max(
                (
                    exp.boundary
                    for exp in mine.values()
                    if exp.boundary_key is not None
                    and exp.boundary // UNIT <= reach
                    and keys[exp.boundary // UNIT - 1] == exp.boundary_key
                ),
                default=0,
            )
        if credit > 0:
            out[index] = credit
    return out


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32), workers=st.integers(1, 6))
def test_credit_matches_brute_force(seed: int, workers: int) -> None:
    rng = random.Random(seed)
    docs = [[rng.randrange(3) for _ in range(rng.randrange(16, 400))] for _ in range(3)]

    def prompt() -> list[int]:
        doc = rng.choice(docs)
        cut = rng.randrange(1, len(doc) + 1)
        return doc[:cut] + [rng.randrange(5, 9) for _ in range(rng.randrange(0, 40))]

    rules = {i: (rng.random() < 0.5, rng.choice([16, 32, 64])) for i in range(workers)}
    exps = Expectations(max_per_worker=8, max_keys=10_000)
    for _ in range(rng.randrange(0, 20)):
        index = rng.randrange(workers)
        ids = prompt()
        exps.add(index, content_keys(ids), len(ids), rules[index][1], UNIT, rng.random() * 10)
    if rng.random() < 0.5:
        exps.expire(rng.random() * 10)
    for _ in range(10):
        ids = prompt()
        keys = content_keys(ids)
        cap = len(ids) - 1
        got = exps.credit(keys, cap, UNIT, rules.__getitem__)
        assert got == brute_force(exps, keys, cap, rules)
        assert exps.reach(keys, cap, UNIT) == brute_reach(exps, keys, cap)


def test_extending_an_expectation_keeps_one_heap_entry_and_the_latest_expiry() -> None:
    exps = Expectations(max_per_worker=8, max_keys=10_000)
    ids = list(range(100, 164))
    keys = content_keys(ids)
    for t in range(1000):
        exps.add(0, keys, len(ids), 16, UNIT, expires_at=10.0 + t)
    assert len(exps._heap) == 1 and len(exps) == 1
    exps.expire(500.0)  # the entry comes up, the expectation lives on: pushed again
    assert len(exps) == 1 and len(exps._heap) == 1
    exps.expire(1009.0)
    assert len(exps) == 0 and exps.expired == 1


def test_the_key_cap_drops_the_soonest_to_expire_even_after_extensions() -> None:
    a, b = list(range(100, 164)), list(range(200, 264))
    exps = Expectations(max_per_worker=8, max_keys=6)  # room for one 4-key prompt
    exps.add(0, content_keys(a), 64, 16, UNIT, expires_at=1.0)
    exps.add(0, content_keys(a), 64, 16, UNIT, expires_at=50.0)  # a now outlives b
    exps.add(1, content_keys(b), 64, 16, UNIT, expires_at=20.0)
    assert len(exps) == 1 and exps.count(0) == 1 and exps.dropped == 1
