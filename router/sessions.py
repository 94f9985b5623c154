"""Where this router placed each live session, and how much cache those sessions hold.

A conversation's later turns return to the worker that holds its history, so where a session
starts decides which worker's cache must keep it for the session's whole life. When new
sessions pile onto the one worker that holds a prefix they share (a tenant's system prompt, an
agent's tool schemas), that worker's cache cannot keep all their histories and evicts them
between turns, while other workers' caches sit half used. `SessionPlacements` remembers, per
session key, the worker of the session's last request and the size of its prompt (the cache
the session occupies there); the policy uses the sums per worker to keep new sessions'
footprint balanced (`policy.new_session_balance`).

Bounded: at most `max_sessions` entries of a fixed size (a 16-byte digest of the key; the least
recently seen are dropped first), and a session not seen for `idle_s` no longer counts.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass


def _digest(key: str) -> bytes:
    # session keys come from clients (a header, the body's `user`): keep 16 bytes, not the key
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()


@dataclass(slots=True)
class _Placement:
    worker: str
    tokens: int
    seen: float


class SessionPlacements:
    """Session key -> (worker, prompt tokens, last seen); per-worker sums of live tokens."""

    def __init__(self, idle_s: float, max_sessions: int) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self._idle_s = idle_s
        self._max = max_sessions
        self._by_key: OrderedDict[bytes, _Placement] = OrderedDict()  # oldest seen first
        self._tokens: dict[str, int] = {}  # worker -> sum of its live sessions' tokens

    def __len__(self) -> int:
        return len(self._by_key)

    def _release(self, p: _Placement) -> None:
        left = self._tokens.get(p.worker, 0) - p.tokens
        if left > 0:
            self._tokens[p.worker] = left
        else:
            self._tokens.pop(p.worker, None)

    def _drop_oldest(self) -> None:
        _, p = self._by_key.popitem(last=False)
        self._release(p)

    def expire(self, now: float) -> None:
        """Forget sessions not seen for `idle_s` (the map is ordered by last seen)."""
        horizon = now - self._idle_s
        by_key = self._by_key
        while by_key:
            first = next(iter(by_key.values()))
            if first.seen > horizon:
                return
            self._drop_oldest()

    def worker_of(self, key: str, now: float) -> str | None:
        """The worker of the session's last request, if the session is live."""
        p = self._by_key.get(_digest(key))
        if p is None or p.seen <= now - self._idle_s:
            return None
        return p.worker

    def record(self, key: str, worker: str, tokens: int, now: float) -> None:
        """The session's request went to `worker` with a `tokens`-long prompt."""
        digest = _digest(key)
        old = self._by_key.pop(digest, None)
        if old is not None:
            self._release(old)
        self._by_key[digest] = _Placement(worker, tokens, now)
        if tokens > 0:
            self._tokens[worker] = self._tokens.get(worker, 0) + tokens
        while len(self._by_key) > self._max:
            self._drop_oldest()

    def tokens_by_worker(self, now: float) -> dict[str, int]:
        """Per worker: the prompt tokens of the live sessions last placed there."""
        self.expire(now)
        return dict(self._tokens)

    def forget_worker(self, worker: str) -> None:
        """A removed worker's sessions have no placement any more."""
        for key in [k for k, p in self._by_key.items() if p.worker == worker]:
            del self._by_key[key]
        self._tokens.pop(worker, None)
