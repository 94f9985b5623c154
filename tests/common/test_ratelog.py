"""The one rate-limited log the bridge and the router share (kvroute.ratelog)."""

from __future__ import annotations

import logging

import pytest

from kvroute.ratelog import RateLimitedLog


def _messages(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records]


def test_a_key_logs_once_per_interval_and_then_counts_what_it_suppressed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    rl = RateLimitedLog(logging.getLogger("t"), interval_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING):
        assert rl.warning("a", "m %s", 1)
        assert not rl.warning("a", "m %s", 2)
        assert not rl.error("a", "m %s", 3)  # the key, not the level, is limited
        assert rl.warning("b", "other")  # another key is not held back
        now[0] = 9.99
        assert not rl.warning("a", "m %s", 4)
        now[0] = 10.0
        assert rl.error("a", "m %s", 5)
        now[0] = 20.0
        assert rl.warning("a", "m %s", 6)  # nothing suppressed since: no count
    assert _messages(caplog) == [
        ("WARNING", "m 1"),
        ("WARNING", "other"),
        ("ERROR", "m 5 (3 similar suppressed)"),
        ("WARNING", "m 6"),
    ]


def test_distinct_keys_are_bounded_oldest_first(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    rl = RateLimitedLog(logging.getLogger("t"), interval_s=60, clock=lambda: now[0], max_keys=3)
    with caplog.at_level(logging.WARNING):
        for key in "abcdef":
            assert rl.warning(key, "k %s", key)
        assert len(rl) == 3
        # "a" was forgotten, so it logs again at once; "f" is remembered and held back
        assert rl.warning("a", "k %s", "a")
        assert not rl.warning("f", "k %s", "f")
    assert len(rl) == 3
    assert [m for _, m in _messages(caplog)] == [f"k {k}" for k in "abcdefa"]


def test_the_default_bound_holds_against_many_distinct_keys() -> None:
    rl = RateLimitedLog(logging.getLogger("t"), interval_s=60)
    for i in range(5000):
        rl.warning(f"k{i}", "m")
    assert len(rl) == 1024
