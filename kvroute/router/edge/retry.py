"""Retry policy: which failures are retried, how long to wait, and a budget that stops retry
storms (retries may be at most `budget_ratio` of recent requests, plus a small floor)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvroute.router.config import RetryConfig

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})


def retryable_status(status: int) -> bool:
    return status in RETRYABLE_STATUS or status >= 500


@dataclass(slots=True)
class RetryBudget:
    """Token bucket: each request deposits `ratio`, time deposits `min_per_s`, a retry takes 1."""

    ratio: float
    min_per_s: float
    cap: float = 0.0
    tokens: float = 0.0
    last: float = 0.0
    _started: bool = field(default=False)

    def __post_init__(self) -> None:
        if self.cap <= 0:
            self.cap = max(10.0, self.min_per_s * 10)
        self.tokens = self.cap

    def on_request(self) -> None:
        self.tokens = min(self.cap, self.tokens + self.ratio)

    def try_spend(self, now: float) -> bool:
        if self._started:
            self.tokens = min(self.cap, self.tokens + (now - self.last) * self.min_per_s)
        self._started = True
        self.last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class Backoff:
    def __init__(self, cfg: RetryConfig, rng: random.Random | None = None) -> None:
        self._cfg = cfg
        self._rng = rng or random.Random()

    def delay(self, retry_number: int) -> float:
        """Wait before retry `retry_number` (1 = first retry), with +-20% jitter."""
        cfg = self._cfg
        base = cfg.backoff_initial_s * cfg.backoff_multiplier ** (retry_number - 1)
        return min(cfg.backoff_max_s, base) * (0.8 + 0.4 * self._rng.random())
