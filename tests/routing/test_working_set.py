"""The working set: conversations by identity, replaced along their key chain, bounded by
a size cap and idle forgetting."""

from __future__ import annotations

import pytest

from kvroute.router.routing.working_set import WorkingSet


def chain(*keys: int) -> list[int]:
    return list(keys)


def test_a_turn_extending_an_earlier_prompt_replaces_its_entry() -> None:
    ws = WorkingSet(max_entries=10, idle_s=100.0, prior_interval_s=60.0)
    first = ws.note(None, chain(1, 2, 3), "w0", 48, 48, now=0.0)
    assert first is not None and first.turns == 1 and first.interval_s is None
    # the next turn's chain starts with the first turn's keys and goes on
    second = ws.note(None, chain(1, 2, 3, 4, 5), "w0", 80, 32, now=10.0)
    assert second is not None
    assert len(ws) == 1 and ws.tokens("w0") == 80
    assert second.turns == 2 and second.interval_s == pytest.approx(10.0)
    assert ws.find(None, chain(1, 2, 3)) is None  # the old identity is gone
    assert ws.find(None, chain(1, 2, 3, 4, 5, 6)) is second
    # a conversation that only shares the start (a system prompt's keys) is a new one
    other = ws.note(None, chain(1, 2, 9), "w1", 48, 16, now=11.0)
    assert len(ws) == 2 and other is not None and other.turns == 1
    # a third turn averages its gap into the interval
    third = ws.note(None, chain(1, 2, 3, 4, 5, 6, 7), "w0", 112, 32, now=30.0)
    assert third is not None and third.turns == 3
    assert third.interval_s == pytest.approx(10.0 + (20.0 - 10.0) / 3)


def test_sessions_are_identified_by_their_key_and_may_move_worker() -> None:
    ws = WorkingSet(max_entries=10, idle_s=100.0, prior_interval_s=60.0)
    ws.note("s1", chain(1, 2), "w0", 32, 32, now=0.0)
    ws.note("s1", chain(7, 8, 9), "w1", 48, 48, now=5.0)  # same session, other prompt
    assert len(ws) == 1
    assert ws.tokens("w0") == 0 and ws.tokens("w1") == 48
    assert [c.ident for c in ws.newest_first("w1")] == [("session", "s1")]
    assert ws.summary("w0", 5.0).conversations == 0


def test_no_identity_is_not_remembered() -> None:
    ws = WorkingSet(max_entries=10, idle_s=100.0, prior_interval_s=60.0)
    assert ws.note(None, None, "w0", 32, 32, now=0.0) is None
    assert ws.note(None, [], "w0", 32, 32, now=0.0) is None
    assert len(ws) == 0


def test_at_the_cap_the_least_recently_routed_are_forgotten() -> None:
    ws = WorkingSet(max_entries=3, idle_s=1e9, prior_interval_s=60.0)
    for i in range(3):
        ws.note(f"s{i}", None, f"w{i % 2}", 100, 100, now=float(i))
    ws.note("s0", None, "w0", 150, 50, now=3.0)  # s0 becomes the most recent
    ws.note("s3", None, "w1", 100, 100, now=4.0)  # one over the cap: s1 goes
    assert len(ws) == 3 and ws.forgotten == 1
    assert ws.find("s1", None) is None
    assert ws.find("s0", None) is not None and ws.find("s2", None) is not None
    assert ws.tokens("w0") == 150 + 100 and ws.tokens("w1") == 100
    for i in range(4, 100):  # stays at the cap under any load
        ws.note(f"s{i}", None, "w0", 10, 10, now=float(i))
        assert len(ws) == 3
    assert ws.forgotten == 97
    assert sum(ws.tokens(w) for w in ("w0", "w1")) == 30


def test_idle_conversations_are_forgotten() -> None:
    ws = WorkingSet(max_entries=100, idle_s=50.0, prior_interval_s=60.0)
    ws.note("old", None, "w0", 100, 100, now=0.0)
    ws.note("live", None, "w0", 200, 200, now=40.0)
    ws.expire(49.0)
    assert len(ws) == 2
    ws.expire(50.0)  # "old" was last seen 50 s ago
    assert ws.find("old", None) is None and ws.find("live", None) is not None
    assert ws.expired == 1 and ws.tokens("w0") == 200
    ws.note("new", None, "w1", 10, 10, now=95.0)  # noting expires too
    assert ws.find("live", None) is None and ws.expired == 2
    assert ws.tokens("w0") == 0 and ws.summary("w0", 95.0).conversations == 0


def test_a_removed_worker_takes_its_conversations_along() -> None:
    ws = WorkingSet(max_entries=100, idle_s=1e9, prior_interval_s=60.0)
    ws.note("a", None, "w0", 100, 100, now=0.0)
    ws.note("b", None, "w1", 100, 100, now=0.0)
    ws.forget_worker("w0")
    assert len(ws) == 1 and ws.tokens("w0") == 0 and ws.write_rate("w0", 1.0) == 0.0


def test_the_write_rate_decays_and_the_fleet_interval_learns() -> None:
    ws = WorkingSet(max_entries=100, idle_s=1e9, prior_interval_s=60.0)
    ws.note("a", None, "w0", 3000, 3000, now=0.0)
    fresh = ws.write_rate("w0", 0.0)
    assert fresh > 0 and ws.write_rate("w0", 60.0) < fresh / 5
    entry = ws.find("a", None)
    assert entry is not None and ws.return_rate(entry) == pytest.approx(1 / 60.0)
    ws.note("a", None, "w0", 3100, 100, now=6.0)
    assert ws.mean_interval_s < 60.0  # one 6 s gap pulls the fleet's average down
    entry = ws.find("a", None)
    assert entry is not None and ws.return_rate(entry) == pytest.approx(1 / 6.0)


def test_a_cap_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        WorkingSet(max_entries=0, idle_s=1.0, prior_interval_s=1.0)


def test_the_same_prompt_again_moves_the_entry_but_is_not_a_return() -> None:
    ws = WorkingSet(max_entries=10, idle_s=100.0, prior_interval_s=60.0)
    ws.note(None, chain(1, 2, 3), "w0", 48, 48, now=0.0)
    ws.note(None, chain(1, 2, 3, 4), "w0", 64, 16, now=20.0)
    retried = ws.note(None, chain(1, 2, 3, 4), "w1", 64, 64, now=20.1)  # a retry elsewhere
    assert retried is not None and retried.worker == "w1"
    assert retried.turns == 2 and retried.interval_s == pytest.approx(20.0)
    assert ws.tokens("w0") == 0 and ws.tokens("w1") == 64
    # with a session: the prompt's last key tells a retry from the next turn
    ws.note("s", chain(7, 8), "w0", 32, 32, now=0.0)
    again = ws.note("s", chain(7, 8), "w0", 32, 0, now=0.5)
    assert again is not None and again.turns == 1 and again.interval_s is None
    later = ws.note("s", chain(7, 8, 9), "w0", 48, 16, now=10.0)
    # the gap counts from the last time the prompt was sent
    assert later is not None and later.turns == 2 and later.interval_s == pytest.approx(9.5)
