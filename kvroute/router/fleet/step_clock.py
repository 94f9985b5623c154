"""A worker's step clock, learned from the streamed chunks the router relays.

vLLM runs one batch step at a time. A request that arrives while a step is in flight waits
for that step to end before the scheduler can take its prefill, and each step's end sends a
chunk to every stream running on the engine. So the chunk arrivals the proxy already sees tell
each worker's step period (the time between step ends) and phase (when the last step ended),
and from those the expected wait for the step in flight when a request would arrive now.

The phase is known only roughly: a step end is seen after the engine wrote the chunks and
the router read them, steps with prefill in them run longer than the median, and the request
reaches the engine a moment after it is routed. A step that looks about to end may already be
over when the request arrives, and then it waits a whole period. So the wait is an
expectation over a step end spread uniformly `uncertainty` periods either side of where the
clock puts it: a worker whose step seems to end any moment is not a sure win (routing to the
smallest point estimate picked exactly those, and measured slower than ignoring the phase).

Arrivals closer together than `merge_s` are one step end (the engine writes each stream's
chunk in turn). Gaps longer than `max_gap_s` are an idle engine, not a step, and are not
counted; the period is the median of the last `window` gaps, so a missed step (a gap of two
periods) or one prefill-heavy step does not move it. Pure: the caller passes the time.
"""

from __future__ import annotations

from collections import deque
from statistics import median


class StepClock:
    """Period and phase of one worker's engine steps (see the module doc)."""

    __slots__ = (
        "_gaps",
        "_last_end",
        "_max_gap",
        "_merge",
        "_period",
        "_period_stale",
        "_stale_periods",
        "_uncertainty",
    )

    def __init__(
        self,
        merge_s: float = 0.003,
        max_gap_s: float = 1.0,
        window: int = 15,
        stale_periods: float = 3.0,
        uncertainty: float = 0.25,
    ) -> None:
        if merge_s <= 0:
            raise ValueError("merge_s must be > 0 (so every counted gap, and the period, is)")
        self._merge = merge_s
        self._uncertainty = uncertainty
        self._max_gap = max_gap_s
        self._stale_periods = stale_periods
        self._gaps: deque[float] = deque(maxlen=window)
        self._last_end: float | None = None
        # The median is taken when the period is read (a decision), not at every relayed
        # chunk: chunks come far more often than decisions.
        self._period: float | None = None
        self._period_stale = False

    @property
    def period(self) -> float | None:
        """The median step period in seconds, once learned."""
        if self._period_stale:
            self._period = median(self._gaps)
            self._period_stale = False
        return self._period

    @property
    def last_end(self) -> float | None:
        """When the last step end was seen (the caller's clock), or None."""
        return self._last_end

    def observe(self, at: float) -> None:
        """A streamed chunk from this worker arrived at time `at`."""
        last = self._last_end
        if last is None:
            self._last_end = at
            return
        gap = at - last
        if gap < self._merge:
            return  # the same step end, another stream's chunk (or out of order)
        self._last_end = at
        if gap > self._max_gap:
            return  # the engine was idle in between: not a step
        self._gaps.append(gap)
        self._period_stale = True

    def expected_wait(self, now: float, busy: bool) -> float:
        """Seconds until the step in flight ends, for a request arriving at `now`.

        0 when the worker is idle (`busy` False: an idle engine starts a step at once) or
        no period is known yet; half a period when the phase is older than `stale_periods`
        periods (the steps went on unseen); else the expected time to the
        next step end on the learned clock, its position uncertain by `uncertainty` periods
        either way (see the module doc). Always within [0, period]."""
        period, last = self.period, self._last_end
        if not busy or period is None or last is None:  # a period implies a last end
            return 0.0
        elapsed = max(0.0, now - last)
        if elapsed > self._stale_periods * period:
            return period / 2
        return _expected_wait(period - (elapsed % period), period, self._uncertainty * period)


def _expected_wait(remaining: float, period: float, spread: float) -> float:
    """E[wait] when the next step end T lies uniformly in [remaining - spread, remaining +
    spread] (remaining in (0, period], spread at most half a period): if T < 0 the step
    ended before the request arrived and it waits for the next one, T + period. So
    E[wait] = remaining + period * P(T < 0). (A later end only lengthens the wait: the
    step seen ending at the last chunk did end.)"""
    spread = min(spread, period / 2)
    if spread <= 0 or remaining >= spread:
        return remaining
    return remaining + period * (spread - remaining) / (2 * spread)
