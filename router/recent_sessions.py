"""Where each conversation was last sent, and how much returning work each worker can expect.

A conversation sent to a worker a few seconds ago will probably come back there (its cache
is there): an agent after its tool call, a chat after its user reads the answer. A cold
prompt (nothing of it cached anywhere) placed on that worker competes with that return: its
prefill queues ahead of the next turn, and under memory pressure it evicts the state the next
turn needs (vLLM frees a finished request's last blocks first, and on hybrid models those
hold the sliding-window or Mamba state at the prompt's end). `RecentSessions` keeps, per
worker, the prompt tokens of the conversations sent there within `window_s`, so the policy
can place a cold prompt where the least is expected back (`TTFTPolicy._cold`).

Bounded: at most `max_sessions` conversations are remembered, the least recently sent
forgotten first (`forgotten` counts them). No clock of its own: callers pass `now`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping


class RecentSessions:
    """Per worker, the prompt tokens of the conversations sent there in the last `window_s`."""

    def __init__(self, window_s: float, max_sessions: int) -> None:
        if window_s <= 0 or max_sessions < 1:
            raise ValueError("window_s must be > 0 and max_sessions >= 1")
        self._window = window_s
        self._max = max_sessions
        # session -> (worker, prompt tokens, when sent); oldest first
        self._last: OrderedDict[str, tuple[str, int, float]] = OrderedDict()
        self._tokens: dict[str, int] = {}  # worker -> sum over sessions within the window
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._last)

    def sent(self, session: str, worker: str, tokens: int, now: float) -> None:
        """`session`'s request of `tokens` prompt tokens was sent to `worker` at `now`."""
        self._expire(now)
        self._drop(session)
        self._last[session] = (worker, tokens, now)
        self._tokens[worker] = self._tokens.get(worker, 0) + tokens
        while len(self._last) > self._max:
            old, _ = next(iter(self._last.items()))
            self._drop(old)
            self.forgotten += 1

    def expected(self, now: float, session: str | None = None) -> Mapping[str, int]:
        """Prompt tokens per worker of the conversations sent there within the window,
        leaving out `session` itself (its own return is not competition). Workers without
        any are absent."""
        self._expire(now)
        own = self._last.get(session) if session is not None else None
        if own is None:
            return {w: t for w, t in self._tokens.items() if t > 0}
        out = dict(self._tokens)
        out[own[0]] -= own[1]
        return {w: t for w, t in out.items() if t > 0}

    def _drop(self, session: str) -> None:
        entry = self._last.pop(session, None)
        if entry is not None:
            worker, tokens, _ = entry
            self._tokens[worker] -= tokens

    def _expire(self, now: float) -> None:
        horizon = now - self._window
        last = self._last
        while last:
            session, (_, _, at) = next(iter(last.items()))
            if at > horizon:
                break
            self._drop(session)
