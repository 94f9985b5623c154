"""uvicorn's own refusals, counted and rate-limited.

Past `edge.limit_concurrency` open connections (or requests) uvicorn answers 503 without
calling the app, and logs one warning per refused request: a connection flood would flood the
log and leave no metric. A filter on uvicorn's logger counts each refusal and lets one line
through per interval, saying how many it held back."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

# what uvicorn 0.54 logs, at WARNING on "uvicorn.error", for each request it refuses
CONCURRENCY_LIMIT_MESSAGE = "Exceeded concurrency limit."
UVICORN_LOGGER = "uvicorn.error"


class ConcurrencyRefusals(logging.Filter):
    """Calls `count()` for each of uvicorn's concurrency-limit warnings and passes at most one
    of them per `interval_s`; every other record passes untouched."""

    def __init__(
        self,
        count: Callable[[], None],
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._count = count
        self._interval_s = interval_s
        self._clock = clock
        self._last: float | None = None
        self.suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != CONCURRENCY_LIMIT_MESSAGE:
            return True
        self._count()
        now = self._clock()
        if self._last is not None and now - self._last < self._interval_s:
            self.suppressed += 1
            return False
        if self.suppressed:
            record.msg = f"{CONCURRENCY_LIMIT_MESSAGE} ({self.suppressed} similar suppressed)"
            record.args = ()
            self.suppressed = 0
        self._last = now
        return True


@contextlib.contextmanager
def counting_refusals(count: Callable[[], None]) -> Iterator[ConcurrencyRefusals]:
    """Install a ConcurrencyRefusals filter on uvicorn's logger for the duration."""
    logger = logging.getLogger(UVICORN_LOGGER)
    refusals = ConcurrencyRefusals(count)
    logger.addFilter(refusals)
    try:
        yield refusals
    finally:
        logger.removeFilter(refusals)
