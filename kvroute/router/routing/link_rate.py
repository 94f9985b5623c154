"""The prefill-to-decode link's bandwidth as decode workers show it.

A decode worker's time from dispatch to first byte is the pull of the prompt tokens it lacked
plus one token's compute and its queue, so (tokens x bytes per token) / seconds measures the
link from below: routing on it errs toward decode workers that pull less. Only pulls of at
least `min_tokens` count (a small pull's time is mostly the rest).
"""

from __future__ import annotations

MIN_TOKENS = 256
WEIGHT = 0.2  # of each new sample in the moving average


class LinkRate:
    """Bytes per second of the link: configured, or learned when `learn` is on."""

    def __init__(self, configured_bytes_per_s: float, *, learn: bool) -> None:
        self._configured = configured_bytes_per_s
        self._learned: float | None = None
        self._learn = learn
        self.samples = 0

    def observe(self, tokens: int, bytes_per_token: int, seconds: float) -> None:
        """One decode's pull: `tokens` prompt tokens reached it `seconds` after dispatch."""
        if tokens < MIN_TOKENS or seconds <= 0:
            return
        rate = tokens * bytes_per_token / seconds
        self._learned = (
            rate if self._learned is None else self._learned + WEIGHT * (rate - self._learned)
        )
        self.samples += 1

    def bytes_per_s(self) -> float:
        """The rate transfers are priced at."""
        if self._learn and self._learned is not None:
            return self._learned
        return self._configured

    @property
    def learned(self) -> float | None:
        """The measured rate so far (None before the first counted pull)."""
        return self._learned
