"""The conversations this router expects back on each worker (its working set).

Every routed prompt is noted under its conversation's identity: the session key when the
request has one, else the prompt's chain of index keys. A key chain identifies a
conversation because each key hashes everything before it: a turn that extends an earlier
prompt contains that prompt's last full-block key, so it replaces that entry (the walk looks
for the longest earlier prompt the new one extends).

Each entry keeps the worker that served it, its prompt tokens, when it was last routed and
its observed return interval (a moving average of the gaps between its turns; until a second
turn the fleet's average gap, starting at `policy.return_interval_s`). Per worker the entries
are kept in least-recently-routed order, which is the order vLLM's LRU pool evicts whole
conversations in, and each worker's write rate (uncached tokens routed there per second) is
tracked so the placement term can tell how soon a block would be evicted anyway.

Bounded: at most `max_entries` conversations (the least recently routed are forgotten first)
and entries idle for `idle_s` seconds are forgotten. It has a clock (it is given times) and so
lives in the router, not in the pure indexer. Each router replica keeps its own: it sees the
conversations it routes (docs/policy.md says what that means for several replicas).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

# a conversation's identity: ("session", its key) or ("chain", its last prompt's last key)
Ident = tuple[str, str | int]
# how fast a conversation's return interval follows a new gap (one gap moves it by a third)
INTERVAL_ALPHA = 1 / 3
# how fast the fleet's average gap follows each conversation's gap
MEAN_ALPHA = 1 / 24
# the time constant of a worker's write rate, seconds
WRITE_TAU_S = 30.0


@dataclass(slots=True)
class Conversation:
    """One conversation the router expects back."""

    ident: Ident  # ("session", key) or ("chain", last key)
    worker: str
    tokens: int  # prompt tokens of its last turn (what its next turn would reuse)
    last_at: float  # when its last turn was routed
    interval_s: float | None = None  # moving average of the gaps between its turns
    turns: int = 1
    prompt_key: int | None = None  # its last prompt's last key (a retry repeats it)


@dataclass(slots=True)
class _Writes:
    """A worker's write rate: uncached tokens routed there, decayed with WRITE_TAU_S."""

    rate: float = 0.0  # tokens per second at `at`
    at: float = 0.0

    def add(self, tokens: int, now: float) -> None:
        self.rate = self.now(now) + tokens / WRITE_TAU_S
        self.at = now

    def now(self, now: float) -> float:
        dt = now - self.at
        return self.rate * math.exp(-dt / WRITE_TAU_S) if dt > 0 else self.rate


@dataclass(frozen=True, slots=True)
class WorkerSet:
    """A worker's working set at a glance (for /admin/workers and the dashboard)."""

    conversations: int
    tokens: int
    write_tokens_per_s: float


class WorkingSet:
    """Conversation identity -> (worker, tokens, last time, return interval), bounded."""

    def __init__(self, max_entries: int, idle_s: float, prior_interval_s: float) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self.idle_s = idle_s
        self.mean_interval_s = prior_interval_s  # the fleet's average gap between turns
        self._all: OrderedDict[Ident, Conversation] = OrderedDict()  # oldest first
        # key-chain entries by their last key (plain ints: the walk in `find` is hot)
        self._chains: dict[int, Conversation] = {}
        self._by_worker: dict[str, OrderedDict[Ident, Conversation]] = {}
        self._tokens: dict[str, int] = {}
        self._writes: dict[str, _Writes] = {}
        self.forgotten = 0  # entries dropped at max_entries
        self.expired = 0  # entries dropped after idle_s

    def __len__(self) -> int:
        return len(self._all)

    @staticmethod
    def identity(session: str | None, keys: Sequence[int] | None) -> Ident | None:
        """A conversation's identity as `note` takes it: the session, else the key chain's
        last key (None when the request has neither)."""
        if session is not None:
            return ("session", session)
        if keys:
            return ("chain", keys[-1])
        return None

    def find(self, session: str | None, keys: Sequence[int] | None) -> Conversation | None:
        """The conversation this request continues: its session's entry, else the entry of
        the longest earlier prompt the key chain extends (None: a new conversation)."""
        if session is not None:
            return self._all.get(("session", session))
        if not keys:
            return None
        chains = self._chains
        if chains.keys().isdisjoint(reversed(keys)):  # a new conversation: one C-level pass
            return None
        get = chains.get
        for key in reversed(keys):
            found = get(key)
            if found is not None:
                return found
        return None

    def note(
        self,
        session: str | None,
        keys: Sequence[int] | None,
        worker: str,
        tokens: int,
        written: int,
        now: float,
    ) -> Conversation | None:
        """A turn of `tokens` prompt tokens was routed to `worker`, writing `written` uncached
        tokens there: its conversation's entry is created or moved (and renamed to the new
        last key), its return interval updated. None when it has no identity."""
        ident = self.identity(session, keys)
        if ident is None:
            return None
        self.expire(now)
        self._writes.setdefault(worker, _Writes()).add(max(0, written), now)
        parent = self.find(session, keys)
        last_key = keys[-1] if keys else None
        entry = Conversation(ident, worker, tokens, now, prompt_key=last_key)
        if parent is not None:
            self._drop(parent)
            gap = now - parent.last_at
            if last_key is not None and parent.prompt_key == last_key:
                # the same prompt again (a retry on another worker, a re-sent request):
                # it moves, but it is not a return
                entry.interval_s, entry.turns = parent.interval_s, parent.turns
            elif gap > 0:
                prior = parent.interval_s
                entry.interval_s = gap if prior is None else prior + INTERVAL_ALPHA * (gap - prior)
                self.mean_interval_s += MEAN_ALPHA * (gap - self.mean_interval_s)
                entry.turns = parent.turns + 1
            else:
                entry.interval_s, entry.turns = parent.interval_s, parent.turns + 1
        self._add(entry)
        while len(self._all) > self.max_entries:
            self._drop(next(iter(self._all.values())))
            self.forgotten += 1
        return entry

    def expire(self, now: float) -> None:
        """Forget the conversations idle for `idle_s` seconds or longer."""
        limit = now - self.idle_s
        idle: list[Conversation] = []
        for entry in self._all.values():  # oldest first: stop at the first one still live
            if entry.last_at > limit:
                break
            idle.append(entry)
        for entry in idle:
            self._drop(entry)
        self.expired += len(idle)

    def newest_first(self, worker: str) -> Iterator[Conversation]:
        """The worker's conversations, most recently routed first (the last vLLM evicts)."""
        entries = self._by_worker.get(worker)
        return reversed(entries.values()) if entries else iter(())

    def tokens(self, worker: str) -> int:
        """The prompt tokens of the worker's conversations, summed."""
        return self._tokens.get(worker, 0)

    def write_rate(self, worker: str, now: float) -> float:
        """Uncached tokens per second routed to the worker lately."""
        w = self._writes.get(worker)
        return 0.0 if w is None else w.now(now)

    def return_rate(self, entry: Conversation) -> float:
        """Expected returns per second of a conversation (its interval, else the fleet's)."""
        interval = entry.interval_s if entry.interval_s is not None else self.mean_interval_s
        return 1.0 / max(interval, 1e-3)

    def summary(self, worker: str, now: float) -> WorkerSet:
        entries = self._by_worker.get(worker)
        return WorkerSet(
            len(entries) if entries else 0, self.tokens(worker), self.write_rate(worker, now)
        )

    def forget_worker(self, worker: str) -> None:
        """A worker left the fleet: its conversations will not find their cache anywhere."""
        for entry in list(self._by_worker.get(worker, {}).values()):
            self._drop(entry)
        self._writes.pop(worker, None)

    def _add(self, entry: Conversation) -> None:
        self._all[entry.ident] = entry
        kind, key = entry.ident
        if kind == "chain" and isinstance(key, int):
            self._chains[key] = entry
        self._by_worker.setdefault(entry.worker, OrderedDict())[entry.ident] = entry
        self._tokens[entry.worker] = self._tokens.get(entry.worker, 0) + entry.tokens

    def _drop(self, entry: Conversation) -> None:
        del self._all[entry.ident]
        kind, key = entry.ident
        if kind == "chain" and isinstance(key, int):
            del self._chains[key]
        per = self._by_worker[entry.worker]
        del per[entry.ident]
        left = self._tokens[entry.worker] - entry.tokens
        if per:
            self._tokens[entry.worker] = left
        else:
            del self._by_worker[entry.worker]
            del self._tokens[entry.worker]
