"""A worker's step clock, learned from the streamed chunks the router relays.

vLLM runs one batch step at a time, and each step's end sends a chunk to every stream
running on the engine. So the chunk arrivals the proxy already sees tell each worker's step
period (the time between step ends), which `/metrics` (`kvroute_worker_step_period_seconds`),
`/admin/workers` and the dashboard show: how long a decode step takes on each engine under
its current batch. (Routing once priced the wait for the step in flight from this clock;
measured no better, it was removed: `docs/decisions/step-wait.md`.)

Arrivals closer together than `merge_s` are one step end (the engine writes each stream's
chunk in turn). Gaps longer than `max_gap_s` are an idle engine, not a step, and are not
counted; the period is the median of the last `window` gaps, so a missed step (a gap of two
periods) or one prefill-heavy step does not move it. Pure: the caller passes the time.
"""

from __future__ import annotations

from collections import deque
from statistics import median


class StepClock:
    """The step period of one worker's engine (see the module doc)."""

    __slots__ = (
        "_gaps",
        "_last_end",
        "_max_gap",
        "_merge",
        "_period",
        "_period_stale",
    )

    def __init__(
        self,
        merge_s: float = 0.003,
        max_gap_s: float = 1.0,
        window: int = 15,
    ) -> None:
        if merge_s <= 0:
            raise ValueError("merge_s must be > 0 (so every counted gap, and the period, is)")
        self._merge = merge_s
        self._max_gap = max_gap_s
        self._gaps: deque[float] = deque(maxlen=window)
        self._last_end: float | None = None
        # The median is taken when the period is read (a scrape of /metrics), not at every
        # relayed chunk: chunks come far more often than reads.
        self._period: float | None = None
        self._period_stale = False

    @property
    def period(self) -> float | None:
        """The median step period in seconds, once learned."""
        if self._period_stale:
            self._period = median(self._gaps)
            self._period_stale = False
        return self._period

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
