"""The step clock (kvroute/router/fleet/step_clock.py) and the policy's use of it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.config import BreakerConfig, PolicyConfig, WorkerSpec
from kvroute.router.fleet.load import LoadTicket
from kvroute.router.fleet.step_clock import StepClock
from kvroute.router.fleet.workers import Worker, WorkerRegistry
from kvroute.router.routing.policy import LoadModel, RouteInput, make_policy


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
    last = ticks(clock, 100.0, 0.034, 12)
    assert clock.period == pytest.approx(0.034, abs=1e-9)
    assert clock.last_end == pytest.approx(last)


def test_a_missed_step_and_an_idle_gap_do_not_move_the_period() -> None:
    clock = StepClock()
    last = ticks(clock, 0.0, 0.02, 10)
    clock.observe(last + 0.04)  # one step went by without a chunk
    ticks(clock, last + 0.06, 0.02, 3)
    assert clock.period == pytest.approx(0.02, abs=1e-9)
    clock.observe(last + 5.0)  # idle for seconds, then a new stream
    assert clock.period == pytest.approx(0.02, abs=1e-9)
    assert clock.last_end == pytest.approx(last + 5.0)


def test_the_period_follows_a_new_step_time_within_the_window() -> None:
    clock = StepClock(window=15)
    last = ticks(clock, 0.0, 0.02, 16)
    ticks(clock, last + 0.05, 0.05, 16)
    assert clock.period == pytest.approx(0.05, abs=1e-9)


def test_expected_wait_on_the_learned_clock() -> None:
    clock = StepClock()
    last = ticks(clock, 10.0, 0.03, 10, streams=1)
    assert clock.expected_wait(last + 0.01, busy=True) == pytest.approx(0.02)
    # a step ended unseen in between: the phase carries on
    assert clock.expected_wait(last + 0.04, busy=True) == pytest.approx(0.02)
    # an idle engine starts a step at once
    assert clock.expected_wait(last + 0.01, busy=False) == 0.0
    # the phase is too old to trust: half a period
    assert clock.expected_wait(last + 0.2, busy=True) == pytest.approx(0.015)
    # nothing learned yet: no wait assumed
    assert StepClock().expected_wait(5.0, busy=True) == 0.0


def test_a_step_that_seems_about_to_end_is_not_a_sure_win() -> None:
    """The clock's phase is rough (chunks are seen late, the request arrives a moment after
    routing): a step end within the uncertainty may be past, costing a whole period."""
    period = 0.04
    clock = StepClock(uncertainty=0.25)  # step end known to +-10 ms
    last = ticks(clock, 0.0, period, 10, streams=1)
    waits = {ms: clock.expected_wait(last + period - ms / 1000, busy=True) for ms in range(0, 41)}
    assert waits[0] == pytest.approx(period / 2)  # as likely missed as not
    assert min(waits, key=lambda ms: waits[ms]) == 10  # the best bet: at the uncertainty
    assert waits[10] == pytest.approx(0.010)
    assert waits[25] == pytest.approx(0.025) and waits[40] == pytest.approx(period)
    # a certain clock gives the point estimate
    exact = StepClock(uncertainty=0.0)
    ticks(exact, 0.0, period, 10, streams=1)
    assert exact.expected_wait(last + period - 0.001, busy=True) == pytest.approx(0.001)


@settings(max_examples=200, deadline=None)
@given(
    arrivals=st.lists(st.floats(0.0, 5.0, allow_nan=False), min_size=0, max_size=60),
    now=st.floats(-1.0, 10.0, allow_nan=False),
    busy=st.booleans(),
)
def test_the_wait_is_never_negative_nor_longer_than_a_period(
    arrivals: list[float], now: float, busy: bool
) -> None:
    clock = StepClock()
    for at in sorted(arrivals):
        clock.observe(at)
    wait = clock.expected_wait(now, busy)
    assert wait >= 0.0
    if clock.period is None or not busy:
        assert wait == 0.0
    else:
        assert clock.period <= 1.0  # gaps over max_gap_s are not steps
        assert wait <= clock.period + 1e-12


def _fleet(n: int) -> list[Worker]:
    reg = WorkerRegistry(BreakerConfig())
    return [reg.add(WorkerSpec(name=f"w{i}", url=f"http://127.0.0.1:{9000 + i}")) for i in range(n)]


def test_the_policy_picks_the_worker_whose_step_ends_first() -> None:
    ws = _fleet(2)
    # both busy with one request, both hold the prompt's prefix; w0's step just began,
    # w1's is about to end
    for w in ws:
        LoadTicket(w.load, 0).prefill_done()
    ticks(ws[0].load.steps, 0.0, 0.03, 10, streams=1)  # last end 0.27
    ticks(ws[1].load.steps, 0.0 - 0.025, 0.03, 10, streams=1)  # last end 0.245
    now = 0.272
    req = RouteInput(2000, {"w0": 1600, "w1": 1600}, None)
    chosen = {}
    for weight in (1.0, 0.0):
        cfg = PolicyConfig(step_wait_weight=weight)
        d = make_policy(cfg, LoadModel(cfg, lambda: 1000.0, 5.0)).decide(ws, req, now)
        assert d.chosen is not None
        chosen[weight] = d.chosen.name
        by = {c.name: c for c in d.candidates}
        if weight:
            assert by["w0"].step_wait_s == pytest.approx(0.028)
            # 3 ms left on the clock, but the end may be past: 3 + 30 * 4.5 / 15 ms
            assert by["w1"].step_wait_s == pytest.approx(0.012)
        else:
            assert by["w0"].step_wait_s == by["w1"].step_wait_s == 0.0
            assert by["w0"].cost_s == by["w1"].cost_s  # a tie, taken in turn
    assert chosen[1.0] == "w1"  # without the wait the two tie, and ties take turns


def test_the_step_wait_does_not_move_a_request_off_its_cache() -> None:
    ws = _fleet(2)
    for w in ws:
        LoadTicket(w.load, 0).prefill_done()
    ticks(ws[0].load.steps, 0.0, 0.03, 10, streams=1)
    ticks(ws[1].load.steps, -0.025, 0.03, 10, streams=1)
    cfg = PolicyConfig(prefill_tokens_per_s=6000.0, step_wait_weight=1.0)
    d = make_policy(cfg, LoadModel(cfg, lambda: 1000.0, 5.0)).decide(
        ws, RouteInput(2000, {"w0": 1600, "w1": 0}, None), 0.272
    )
    # 25 ms more wait on w0 against 1,600 tokens (~0.27 s) of prefill on w1
    assert d.chosen is not None and d.chosen.name == "w0"


def test_a_merge_window_of_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="merge_s"):
        StepClock(merge_s=0.0)
