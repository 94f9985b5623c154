"""Session placements: per-session memory of where it lives, per-worker sums, the bounds."""

from __future__ import annotations

import random

import pytest

from router.sessions import SessionPlacements


def test_record_moves_a_session_and_keeps_the_sums() -> None:
    s = SessionPlacements(idle_s=30.0, max_sessions=100)
    s.record("a", "w0", 1000, 0.0)
    s.record("b", "w0", 500, 1.0)
    s.record("c", "w1", 700, 2.0)
    assert s.tokens_by_worker(3.0) == {"w0": 1500, "w1": 700}
    assert s.worker_of("a", 3.0) == "w0" and s.worker_of("zzz", 3.0) is None
    s.record("a", "w1", 1200, 4.0)  # the next turn, longer, moved
    assert s.tokens_by_worker(4.0) == {"w0": 500, "w1": 1900}
    assert s.worker_of("a", 4.0) == "w1" and len(s) == 3


def test_idle_sessions_stop_counting() -> None:
    s = SessionPlacements(idle_s=10.0, max_sessions=100)
    s.record("a", "w0", 1000, 0.0)
    s.record("b", "w1", 500, 5.0)
    s.record("a", "w0", 1100, 8.0)  # seen again: its clock restarts
    assert s.worker_of("b", 15.0) is None  # 10 s idle: not live any more
    assert s.tokens_by_worker(15.0) == {"w0": 1100}
    assert len(s) == 1
    assert s.tokens_by_worker(18.0) == {} and s.worker_of("a", 18.0) is None and len(s) == 0


def test_bounded_the_least_recently_seen_go_first() -> None:
    s = SessionPlacements(idle_s=1e9, max_sessions=3)
    for i in range(5):
        s.record(f"s{i}", f"w{i % 2}", 100, float(i))
    assert len(s) == 3
    assert [s.worker_of(f"s{i}", 5.0) for i in range(5)] == [None, None, "w0", "w1", "w0"]
    assert s.tokens_by_worker(5.0) == {"w0": 200, "w1": 100}
    with pytest.raises(ValueError):
        SessionPlacements(idle_s=1.0, max_sessions=0)


def test_a_removed_worker_forgets_its_sessions() -> None:
    s = SessionPlacements(idle_s=30.0, max_sessions=100)
    s.record("a", "w0", 1000, 0.0)
    s.record("b", "w1", 500, 0.0)
    s.forget_worker("w0")
    assert s.worker_of("a", 1.0) is None and s.tokens_by_worker(1.0) == {"w1": 500}
    s.record("a", "w1", 100, 2.0)
    assert s.tokens_by_worker(2.0) == {"w1": 600}


def test_sums_match_a_recount_under_random_use() -> None:
    rng = random.Random(7)
    s = SessionPlacements(idle_s=20.0, max_sessions=25)
    model: dict[str, tuple[str, int, float]] = {}
    now = 0.0
    for _ in range(3000):
        now += rng.random()
        op = rng.random()
        if op < 0.8:
            key, w, n = f"s{rng.randrange(60)}", f"w{rng.randrange(4)}", rng.randrange(1, 5000)
            s.record(key, w, n, now)
            model.pop(key, None)
            model[key] = (w, n, now)
            while len(model) > 25:
                model.pop(next(iter(model)))
        elif op < 0.82:
            w = f"w{rng.randrange(4)}"
            s.forget_worker(w)
            model = {k: v for k, v in model.items() if v[0] != w}
        live = {k: v for k, v in model.items() if v[2] > now - 20.0}
        expected: dict[str, int] = {}
        for w, n, _ in live.values():
            expected[w] = expected.get(w, 0) + n
        assert s.tokens_by_worker(now) == expected
        key = f"s{rng.randrange(60)}"
        assert s.worker_of(key, now) == (live[key][0] if key in live else None)


def test_zero_token_sessions_and_huge_keys() -> None:
    s = SessionPlacements(idle_s=30.0, max_sessions=100)
    s.record("a", "w0", 0, 0.0)
    s.record("b", "w0", 0, 0.0)
    s.record("a", "w1", 10, 1.0)  # moving a zero-token session leaves nothing behind
    s.record("b", "w1", 0, 1.0)
    assert s.tokens_by_worker(2.0) == {"w1": 10}
    assert s.worker_of("a", 2.0) == "w1" and s.worker_of("b", 2.0) == "w1"
    big = "k" * 1_000_000  # a client's key is kept as a 16-byte digest, whatever its size
    s.record(big, "w2", 5, 3.0)
    assert s.worker_of(big, 3.0) == "w2" and s.worker_of(big[:-1], 3.0) is None
    assert all(len(k) == 16 for k in s._by_key)
