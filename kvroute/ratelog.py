"""Logging that says a thing once per interval per key, so bad input cannot flood the log.

Shared by the bridge and the router (it depends on nothing of either)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

KEYS_KEPT = 1024


class RateLimitedLog:
    """`warning(key, msg, *args)` / `error(...)` log at most once per `interval_s` for each
    key; the next message logged for a key says how many were suppressed in between.

    At most `max_keys` keys are remembered (the least recently logged is forgotten first),
    so distinct bad inputs cannot grow it. Thread-safe: the tokenizer logs from its pool."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = KEYS_KEPT,
    ) -> None:
        self._logger = logger
        self._interval = interval_s
        self._clock = clock
        self._max_keys = max_keys
        # key -> [when last logged, how many suppressed since]
        self._last: OrderedDict[str, list[float]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """How many keys are remembered."""
        return len(self._last)

    def _due(self, key: str) -> int | None:
        """None when `key` was logged within the interval, else how many were suppressed."""
        now = self._clock()
        with self._lock:
            seen = self._last.get(key)
            if seen is not None and now - seen[0] < self._interval:
                seen[1] += 1
                return None
            self._last[key] = [now, 0]
            self._last.move_to_end(key)
            while len(self._last) > self._max_keys:
                self._last.popitem(last=False)
            return 0 if seen is None else int(seen[1])

    def warning(self, key: str, msg: str, *args: object) -> bool:
        """Log at WARNING unless `key` was logged within the interval; whether it logged."""
        return self._log(logging.WARNING, key, msg, args)

    def error(self, key: str, msg: str, *args: object) -> bool:
        """Log at ERROR unless `key` was logged within the interval; whether it logged."""
        return self._log(logging.ERROR, key, msg, args)

    def _log(self, level: int, key: str, msg: str, args: tuple[object, ...]) -> bool:
        suppressed = self._due(key)
        if suppressed is None:
            return False
        if suppressed:
            msg = f"{msg} ({suppressed} similar suppressed)"
        self._logger.log(level, msg, *args)
        return True
