"""Logging that says a thing once per interval per key, so bad input cannot flood the log."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

_KEYS_KEPT = 1024


class RateLimitedLog:
    """`warning(key, msg, *args)` logs at most once per `interval_s` for each key."""

    def __init__(self, logger: logging.Logger, interval_s: float = 60.0) -> None:
        self._logger = logger
        self._interval = interval_s
        self._last: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def _due(self, key: str) -> bool:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._interval:
                return False
            self._last[key] = now
            self._last.move_to_end(key)
            while len(self._last) > _KEYS_KEPT:
                self._last.popitem(last=False)
            return True

    def warning(self, key: str, msg: str, *args: object) -> None:
        if self._due(key):
            self._logger.warning(msg, *args)

    def error(self, key: str, msg: str, *args: object) -> None:
        if self._due(key):
            self._logger.error(msg, *args)
