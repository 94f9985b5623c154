"""Speculative entries: what the router just sent where, before the worker's events say so.

A burst of requests with the same new prefix should follow the first one to its worker.
`expect` records the prompt's content keys for that worker until `expires_at` (time is
passed in; the index has no clock). Scoring credits a worker with the part of a request
an expectation covers, the way vLLM would reuse it once the expected prompt has run:

- a worker whose groups are all full attention: the common prefix, aligned down;
- any other worker (sliding window, Mamba, or layout unknown): only the expected
  prompt's replay boundary (its length - 1 aligned down), where vLLM keeps state under
  its default retention, and only if the request reaches it.

An expectation disappears when it expires or when the worker's events confirm it (a
group reports the block at its replay boundary). Bounded per worker and in total.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class _Expectation:
    index: int
    keys: list[int]  # content keys of the expected prompt, up to its last full unit
    boundary_key: int | None  # the key at the replay boundary
    boundary: int  # the replay boundary, tokens
    expires_at: float
    junction_key: int | None = None  # the key at a shared-prefix junction vLLM will save


class Expectations:
    """Live expectations of every worker, as inverted maps key -> worker bitset."""

    def __init__(self, max_per_worker: int, max_keys: int) -> None:
        self._max_per_worker = max_per_worker
        self._max_keys = max_keys
        self._prefix: dict[int, int] = {}  # key -> workers expecting a prompt through it
        self._prefix_counts: dict[tuple[int, int], int] = {}
        self._by_worker: dict[int, dict[int, _Expectation]] = {}  # index -> id -> exp
        self._heap: list[tuple[float, int, int]] = []  # (expires_at, id, index)
        self._next_id = 0
        self._keys = 0
        self.expired = 0
        self.confirmed = 0
        self.dropped = 0

    @property
    def active(self) -> bool:
        """Whether any expectation is live."""
        return bool(self._prefix)

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_worker.values())

    def count(self, index: int) -> int:
        """Live expectations of one worker."""
        return len(self._by_worker.get(index, ()))

    @staticmethod
    def _inc(inv: dict[int, int], counts: dict[tuple[int, int], int], key: int, index: int) -> None:
        n = counts.get((key, index), 0)
        counts[key, index] = n + 1
        if n == 0:
            inv[key] = inv.get(key, 0) | (1 << index)

    @staticmethod
    def _dec(inv: dict[int, int], counts: dict[tuple[int, int], int], key: int, index: int) -> None:
        n = counts.get((key, index), 0)
        if n > 1:
            counts[key, index] = n - 1
            return
        counts.pop((key, index), None)
        bits = inv.get(key, 0) & ~(1 << index)
        if bits:
            inv[key] = bits
        else:
            inv.pop(key, None)

    def add(
        self,
        index: int,
        keys: Sequence[int],
        n_tokens: int,
        alignment: int,
        hash_unit: int,
        expires_at: float,
        junction: int = 0,
    ) -> None:
        """Expect worker `index` to hold the prompt (n_tokens, these content keys) until
        `expires_at`. `junction` (tokens, 0 = none): where the worker's full attention held
        the prompt beyond its reuse, so vLLM saves sliding-window / Mamba state there too."""
        if not keys:
            return
        boundary = max(n_tokens - 1, 0)
        boundary -= boundary % alignment
        mine = self._by_worker.setdefault(index, {})
        for exp in mine.values():  # the same prompt again: extend it
            if exp.keys[-1] == keys[-1] and exp.boundary == boundary:
                # its heap entry is pushed again, with the new time, when it comes up
                exp.expires_at = max(exp.expires_at, expires_at)
                return
        unit_keys = list(keys)
        boundary_key = unit_keys[boundary // hash_unit - 1] if boundary else None
        exp_id = self._next_id
        self._next_id += 1
        junction -= junction % alignment
        junction_key = unit_keys[junction // hash_unit - 1] if 0 < junction < boundary else None
        exp = _Expectation(index, unit_keys, boundary_key, boundary, expires_at, junction_key)
        mine[exp_id] = exp
        for key in unit_keys:
            self._inc(self._prefix, self._prefix_counts, key, index)
        self._keys += len(unit_keys)
        heapq.heappush(self._heap, (expires_at, exp_id, index))
        self._enforce_bounds(index)

    def _enforce_bounds(self, index: int) -> None:
        """Beyond a bound, drop the expectations that expire first: the worker's own for its
        count, anyone's for the total of keys."""
        mine = self._by_worker[index]
        while len(mine) > self._max_per_worker:
            self._remove(index, min(mine, key=lambda i: mine[i].expires_at))
            self.dropped += 1
        while self._keys > self._max_keys and self._heap:
            at, victim, vindex = heapq.heappop(self._heap)
            found = self._by_worker.get(vindex, {}).get(victim)
            if found is None:
                continue
            if found.expires_at > at:  # extended since: not the soonest to expire
                heapq.heappush(self._heap, (found.expires_at, victim, vindex))
                continue
            self._remove(vindex, victim)
            self.dropped += 1

    def _remove(self, index: int, exp_id: int) -> None:
        mine = self._by_worker.get(index)
        if mine is None or exp_id not in mine:
            return
        exp = mine.pop(exp_id)
        if not mine:
            del self._by_worker[index]
        for key in exp.keys:
            self._dec(self._prefix, self._prefix_counts, key, index)
        self._keys -= len(exp.keys)

    def move(self, old: int, new: int) -> None:
        """A worker's index changed from `old` to `new`: its expectations follow."""
        mine = self._by_worker.pop(old, None)
        if not mine:
            return
        prefix, prefix_counts = self._prefix, self._prefix_counts
        for exp_id, exp in mine.items():
            for key in exp.keys:
                self._dec(prefix, prefix_counts, key, old)
                self._inc(prefix, prefix_counts, key, new)
            exp.index = new
            heapq.heappush(self._heap, (exp.expires_at, exp_id, new))  # old entries: no-ops
        self._by_worker[new] = mine

    def expire(self, now: float) -> None:
        """Drop expectations with expires_at <= now."""
        while self._heap and self._heap[0][0] <= now:
            at, exp_id, index = heapq.heappop(self._heap)
            exp = self._by_worker.get(index, {}).get(exp_id)
            if exp is None:
                continue
            if exp.expires_at <= now:
                self._remove(index, exp_id)
                self.expired += 1
            elif exp.expires_at > at:  # extended since it was pushed
                heapq.heappush(self._heap, (exp.expires_at, exp_id, index))

    def remove_worker(self, index: int) -> None:
        """Drop every expectation of a worker (it left the fleet)."""
        for exp_id in list(self._by_worker.get(index, {})):
            self._remove(index, exp_id)

    def confirm(self, index: int, holds: Callable[[int], bool]) -> None:
        """Drop the worker's expectations its events now confirm."""
        mine = self._by_worker.get(index)
        if not mine:
            return
        done = [
            exp_id
            for exp_id, exp in mine.items()
            if exp.boundary_key is not None and holds(exp.boundary_key)
        ]
        for exp_id in done:
            self._remove(index, exp_id)
            self.confirmed += 1

    def credit(
        self,
        keys: Sequence[int],
        cap: int,
        hash_unit: int,
        rule_of: Callable[[int], tuple[bool, int]],
    ) -> dict[int, int]:
        """Credited tokens per worker index for a request. `rule_of(index)` gives
        (all groups full attention, alignment) for a worker."""
        return self.credit_from_reach(self.reach(keys, cap, hash_unit), keys, hash_unit, rule_of)

    def reach(self, keys: Sequence[int], cap: int, hash_unit: int) -> dict[int, int]:
        """Per worker index, the request's prefix (in hash units, up to `cap` tokens) that
        the worker's expectations share.

        The workers expecting the request's key i can only shrink as i grows (a key
        commits to its whole prefix), so the common prefix of each worker is found by
        bisecting between the positions where that set changes: a few lookups per
        distinct answer, not two per prompt block."""
        if not self._prefix or cap <= 0:
            return {}
        m = min(len(keys), cap // hash_unit)
        if m <= 0:
            return {}
        get = self._prefix.get
        reach: dict[int, int] = {}  # index -> common prefix in units
        lo, alive = 0, get(keys[0], 0)  # holders of keys[lo]; all of them hold keys[:lo]
        while alive:
            hi = m - 1
            if get(keys[hi], 0) & alive == alive:  # every one of them reaches the end
                for index in _indexes(alive):
                    reach[index] = m
                break
            while hi - lo > 1:  # invariant: keys[lo] held by all of alive, keys[hi] not
                mid = (lo + hi) // 2
                if get(keys[mid], 0) & alive == alive:
                    lo = mid
                else:
                    hi = mid
            rest = get(keys[hi], 0) & alive
            for index in _indexes(alive & ~rest):
                reach[index] = hi
            lo, alive = hi, rest
        return reach

    def credit_from_reach(
        self,
        reach: dict[int, int],
        keys: Sequence[int],
        hash_unit: int,
        rule_of: Callable[[int], tuple[bool, int]],
    ) -> dict[int, int]:
        """`credit` from what `reach` returned for the same request: full-attention-only
        workers are credited the shared prefix (aligned), the others only up to a replay
        boundary of an expected prompt (where their sparse groups will hold state)."""
        out: dict[int, int] = {}
        for index, units in reach.items():
            full_only, alignment = rule_of(index)
            if full_only:
                tokens = units * hash_unit
                credit = tokens - tokens % alignment
            else:
                credit = self._boundary_reached(index, keys, units) * hash_unit
            if credit > 0:
                out[index] = credit
        return out

    def _boundary_reached(self, index: int, keys: Sequence[int], units: int) -> int:
        """The furthest replay boundary or junction (in units) of the worker's expectations
        within the request's first `units` keys, or 0 (a key carries its end position in
        units)."""
        best = 0
        for exp in self._by_worker.get(index, {}).values():
            for key in (exp.boundary_key, exp.junction_key):
                if key is None:
                    continue
                at = key >> 64
                if best < at <= units and keys[at - 1] == key:
                    best = at
        return best


def _indexes(bits: int) -> list[int]:
    out = []
    while bits:
        low = bits & -bits
        out.append(low.bit_length() - 1)
        bits ^= low
    return out
