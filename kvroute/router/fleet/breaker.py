"""Per-worker circuit breaker: stop sending to a worker that keeps failing, probe it later.

closed --(failure_threshold consecutive failures)--> open
open --(open_s elapsed)--> half_open: one probe request at a time
half_open --(half_open_successes successes)--> closed;  --(any failure)--> open again

The clock is passed in (`now`), so the logic is deterministic and testable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"
STATE_CODES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}  # for the metrics gauge


@dataclass(slots=True)
class CircuitBreaker:
    failure_threshold: int = 5
    open_s: float = 10.0
    half_open_successes: int = 2
    on_change: Callable[[str, str], None] | None = None  # (old, new) state

    state: str = CLOSED
    failures: int = 0
    successes: int = 0
    opened_at: float = 0.0
    probe_in_flight: bool = False

    def allows(self, now: float) -> bool:
        """Whether a new request may be sent now (does not reserve the probe slot)."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            return now - self.opened_at >= self.open_s
        return not self.probe_in_flight

    def on_send(self, now: float) -> None:
        """A request is being sent; in half-open (or open past its time) it is the probe."""
        if self.state == OPEN and now - self.opened_at >= self.open_s:
            self._move(HALF_OPEN)
            self.successes = 0
        if self.state == HALF_OPEN:
            self.probe_in_flight = True

    def record_success(self) -> None:
        self.probe_in_flight = False
        if self.state == HALF_OPEN:
            self.successes += 1
            if self.successes >= self.half_open_successes:
                self._move(CLOSED)
                self.failures = 0
        else:
            self.failures = 0

    def record_failure(self, now: float) -> None:
        self.probe_in_flight = False
        if self.state == HALF_OPEN:
            self._open(now)
            return
        self.failures += 1
        if self.state == CLOSED and self.failures >= self.failure_threshold:
            self._open(now)

    def release(self) -> None:
        """The request ended without a verdict (client went away): free the probe slot."""
        self.probe_in_flight = False

    def reset(self) -> None:
        """Close unconditionally (an operator re-added the worker, or health came back)."""
        self._move(CLOSED)
        self.failures = 0
        self.successes = 0
        self.probe_in_flight = False

    def _open(self, now: float) -> None:
        self._move(OPEN)
        self.opened_at = now
        self.successes = 0

    def _move(self, new: str) -> None:
        old, self.state = self.state, new
        if old != new and self.on_change is not None:
            self.on_change(old, new)
