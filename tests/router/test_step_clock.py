"""The step clock (kvroute/router/fleet/step_clock.py): the step period from relayed chunks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.fleet.step_clock import StepClock


def ticks(clock: StepClock, start: float, period: float, steps: int, streams: int = 3) -> float:
    """Feed `steps` step ends `period` apart, each seen by `streams` chunks 0.4 ms apart;
    returns the time of the last step end."""
    t = start
    for i in range(steps):
        t = start + i * period
        for k in range(streams):
            clock.observe(t + k * 0.0004)
    return t


def test_learns_the_period_and_merges_the_chunks_of_one_step() -> None:
    clock = StepClock()
    assert clock.period is None
    ticks(clock, 100.0, 0.034, 12)
    # exact: the 2nd and 3rd chunk of a step (0.4 ms apart) neither add a gap nor move the end
    assert clock.period == pytest.approx(0.034, abs=1e-9)


def test_a_missed_step_and_an_idle_gap_do_not_move_the_period() -> None:
    clock = StepClock()
    last = ticks(clock, 0.0, 0.02, 10)
    clock.observe(last + 0.04)  # one step went by without a chunk
    ticks(clock, last + 0.06, 0.02, 3)
    assert clock.period == pytest.approx(0.02, abs=1e-9)
    clock.observe(last + 5.0)  # idle for seconds, then a new stream
    assert clock.period == pytest.approx(0.02, abs=1e-9)


def test_after_an_idle_gap_the_next_gap_counts_from_the_new_stream() -> None:
    clock = StepClock()
    clock.observe(0.0)
    clock.observe(5.0)  # idle: not a step, but the new stream's first step end
    assert clock.period is None
    clock.observe(5.03)
    assert clock.period == pytest.approx(0.03, abs=1e-9)


def test_the_period_follows_a_new_step_time_within_the_window() -> None:
    clock = StepClock(window=15)
    last = ticks(clock, 0.0, 0.02, 16)
    ticks(clock, last + 0.05, 0.05, 16)
    assert clock.period == pytest.approx(0.05, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(arrivals=st.lists(st.floats(0.0, 5.0, allow_nan=False), min_size=0, max_size=60))
def test_the_period_is_a_gap_between_merge_and_idle(arrivals: list[float]) -> None:
    clock = StepClock(merge_s=0.003, max_gap_s=1.0)
    for at in sorted(arrivals):
        clock.observe(at)
    if clock.period is not None:
        assert 0.003 <= clock.period <= 1.0  # merged chunks and idle gaps are not steps


def test_a_merge_window_of_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="merge_s"):
        StepClock(merge_s=0.0)
