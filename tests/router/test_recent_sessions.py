"""RecentSessions: per worker, the prompt tokens of conversations sent there lately."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.recent_sessions import RecentSessions


def test_a_conversation_counts_where_it_was_last_sent_until_the_window_passes() -> None:
    r = RecentSessions(window_s=10.0, max_sessions=100)
    r.sent("a", "w0", 3000, now=0.0)
    r.sent("b", "w1", 500, now=1.0)
    assert r.expected(2.0) == {"w0": 3000, "w1": 500}
    # its own return is not competition
    assert r.expected(2.0, session="a") == {"w1": 500}
    assert r.expected(2.0, session="zzz") == {"w0": 3000, "w1": 500}
    # its next turn moves it (and replaces its size)
    r.sent("a", "w1", 4000, now=3.0)
    assert r.expected(3.0) == {"w1": 4500}
    # the window passes for b (sent at 1.0), then for a (sent at 3.0)
    assert r.expected(11.0) == {"w1": 4000}
    assert r.expected(13.0) == {}
    assert len(r) == 0


def test_the_oldest_conversations_are_forgotten_at_the_bound() -> None:
    r = RecentSessions(window_s=60.0, max_sessions=2)
    r.sent("a", "w0", 100, now=0.0)
    r.sent("b", "w1", 200, now=1.0)
    r.sent("c", "w2", 300, now=2.0)
    assert len(r) == 2 and r.forgotten == 1
    assert r.expected(3.0) == {"w1": 200, "w2": 300}
    r.sent("b", "w1", 250, now=4.0)  # b is now the newest: c goes next
    r.sent("d", "w0", 50, now=5.0)
    assert r.expected(6.0) == {"w1": 250, "w0": 50} and r.forgotten == 2


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        RecentSessions(window_s=0.0, max_sessions=10)
    with pytest.raises(ValueError):
        RecentSessions(window_s=1.0, max_sessions=0)


_STEP = st.tuples(
    st.sampled_from("abcdef"),  # session
    st.sampled_from(["w0", "w1", "w2"]),
    st.integers(1, 5000),  # tokens
    st.floats(0.0, 4.0),  # time since the previous step
    st.sampled_from([None, "a", "b", "zzz"]),  # whose view is asked for
)


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(_STEP, max_size=40), window=st.floats(0.5, 8.0), bound=st.integers(1, 6))
def test_matches_a_recount_from_the_history(
    steps: list[tuple[str, str, int, float, str | None]], window: float, bound: int
) -> None:
    r = RecentSessions(window_s=window, max_sessions=bound)
    kept: dict[str, tuple[str, int, float, int]] = {}  # session -> worker, tokens, at, order
    now = 0.0
    for order, (session, worker, tokens, dt, asker) in enumerate(steps):
        now += dt
        r.sent(session, worker, tokens, now)
        # the model: last send per session, only the `bound` most recently sent kept, and a
        # send older than the window forgotten for good
        kept = {s: v for s, v in kept.items() if v[2] > now - window}
        kept[session] = (worker, tokens, now, order)
        while len(kept) > bound:
            del kept[min(kept, key=lambda s: (kept[s][2], kept[s][3]))]
        want: dict[str, int] = {}
        for s, (w, t, _, _) in kept.items():
            if s != asker:
                want[w] = want.get(w, 0) + t
        assert r.expected(now, asker) == {w: t for w, t in want.items() if t > 0}
