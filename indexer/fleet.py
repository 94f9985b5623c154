"""`FleetIndex`: every worker's view, and scoring that does not grow with the fleet."""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass
from itertools import compress, repeat

from indexer.feed import Feed
from indexer.fleet_score import score_fast
from indexer.group_cache import explain_layout
from indexer.inverted import InvertedIndex, WorkerPresence, WorkerSink
from indexer.keys import Namespace, content_keys
from indexer.layout import Layout, Rule, check_alignment
from indexer.lineage import Lineage
from indexer.plan import Plan, build_plan
from indexer.results import WorkerScore, WorkerStats
from indexer.speculative import Expectations
from proto import events_pb2

_BITS = bytes.maketrans(b"01", b"\x00\x01")


@dataclass(slots=True)
class _Worker:
    worker_id: str
    index: int
    sink: WorkerSink
    feed: Feed
    seen_version: int = -1

    @property
    def lineage(self) -> Lineage:
        return self.feed.lineage


class FleetIndex:
    """The index of a fleet: apply each worker's batches, score requests for all workers.

    `score` hashes the request once and answers every worker together from an inverted
    index (content key -> workers, per group slot, as integer bitsets), so its cost grows
    with the prompt, not with prompt x workers. Workers with different layouts (rolling
    upgrades, several models) are scored by their own rules.
    """

    def __init__(
        self,
        hash_unit: int = 16,
        *,
        max_entries_per_worker: int = 2_000_000,
        max_pending_per_worker: int = 100_000,
        max_expectations_per_worker: int = 64,
        max_expected_keys: int = 262_144,
    ) -> None:
        if hash_unit <= 0:
            raise ValueError("hash_unit must be positive")
        self.hash_unit = hash_unit
        self._max_entries = max_entries_per_worker
        self._max_pending = max_pending_per_worker
        self._inv = InvertedIndex()
        self._workers: dict[str, _Worker] = {}
        self._names: list[str | None] = []  # by worker index
        self._free: list[int] = []  # reusable indexes (a heap: keep bitsets short)
        self._plan: Plan | None = None
        self._unscored: dict[str, int | None] = {}  # each worker's answer before any hit
        self._expectations = Expectations(max_expectations_per_worker, max_expected_keys)

    # -- workers and events -----------------------------------------------------------------

    def _worker(self, worker_id: str) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None:
            if self._free:
                index = heapq.heappop(self._free)
                self._names[index] = worker_id
            else:
                index = len(self._names)
                self._names.append(worker_id)
            sink = WorkerSink(self._inv, index)
            lineage = Lineage(sink, self.hash_unit, self._max_entries, self._max_pending)
            w = _Worker(worker_id, index, sink, Feed(lineage))
            self._workers[worker_id] = w
            self._plan = None
        return w

    def _view_changed(self, w: _Worker) -> None:
        """Replan if the worker's layout changed; drop expectations its events confirm."""
        version = w.lineage.layout_version
        if version != w.seen_version:
            w.seen_version = version
            self._plan = None
        self._expectations.confirm(w.index, w.sink.holds)

    def apply(self, worker_id: str, batch: events_pb2.KvEventBatch) -> None:
        """Apply one of the worker's batches (sequence order: stale ignored, a gap
        discards the view and then applies the batch)."""
        w = self._worker(worker_id)
        w.feed.apply(batch)
        self._view_changed(w)

    def apply_snapshot(self, worker_id: str, snapshot: events_pb2.Snapshot) -> None:
        """Replace the worker's view with a snapshot."""
        w = self._worker(worker_id)
        w.feed.apply_snapshot(snapshot)
        self._view_changed(w)

    def invalidate(self, worker_id: str) -> None:
        """The worker's stream was lost: no score (None) until new evidence."""
        w = self._worker(worker_id)
        w.feed.invalidate()
        self._view_changed(w)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker entirely."""
        w = self._workers.pop(worker_id, None)
        if w is None:
            return
        w.lineage.discard()
        self._expectations.remove_worker(w.index)
        self._names[w.index] = None
        heapq.heappush(self._free, w.index)
        self._plan = None

    def set_alignment(self, worker_id: str, alignment: int | None) -> None:
        """Override the worker's inferred hit alignment (vLLM's scheduler block size or
        hash unit, for layouts the events cannot reveal); None infers it again."""
        check_alignment(alignment, self.hash_unit)
        w = self._worker(worker_id)
        w.lineage.set_alignment(alignment)
        self._view_changed(w)

    def workers(self) -> list[str]:
        """Ids of the workers the index knows, in the order they were first seen."""
        return list(self._workers)

    def stats(self, worker_id: str) -> WorkerStats:
        """The worker's counters and sizes; KeyError for an unknown worker."""
        w = self._workers.get(worker_id)
        if w is None:
            raise KeyError(worker_id)
        return dataclasses.replace(w.feed.stats(), expectations=self._expectations.count(w.index))

    def layout(self, worker_id: str) -> Layout:
        """The worker's cache layout as learned from its events."""
        return self._workers[worker_id].lineage.layout()

    # -- speculative entries ---------------------------------------------------------------

    def expect(
        self,
        worker_id: str,
        token_ids: Sequence[int],
        namespace: Namespace | None,
        expires_at: float,
    ) -> None:
        """Record that a prompt was just sent to a worker: until `expires_at` (or until
        the worker's events confirm it), requests sharing it are credited there."""
        w = self._worker(worker_id)
        layout = w.lineage.layout()
        alignment = layout.alignment if layout.usable else self.hash_unit
        keys = content_keys(token_ids, namespace, self.hash_unit)
        self._expectations.add(w.index, keys, len(token_ids), alignment, self.hash_unit, expires_at)

    def expire(self, now: float) -> None:
        """Drop expectations with expires_at <= now."""
        self._expectations.expire(now)

    def _credit(self, keys: Sequence[int], n_tokens: int) -> dict[int, int]:
        def rule_of(index: int) -> tuple[bool, int]:
            name = self._names[index]
            assert name is not None
            layout = self._workers[name].lineage.layout()
            if not layout.usable:
                return False, self.hash_unit
            return all(u.rule is Rule.FULL for u in layout.units), layout.alignment

        return self._expectations.credit(keys, n_tokens - 1, self.hash_unit, rule_of)

    # -- scoring ---------------------------------------------------------------------------

    def _current_plan(self) -> Plan:
        if self._plan is None:
            plan = build_plan({w.index: w.lineage.layout() for w in self._workers.values()})
            # the answer before any hit: 0 for usable workers, None for the others
            self._unscored = {
                name: (0 if plan.usable >> w.index & 1 else None)
                for name, w in self._workers.items()
            }
            self._plan = plan
        return self._plan

    def _select(self, bits: int) -> Iterator[str]:
        """Worker ids of the set bits."""
        flags = bin(bits)[:1:-1].encode().translate(_BITS)
        return compress(self._names, flags)  # type: ignore[arg-type]

    def _presence(self, w: _Worker) -> dict[int, Container[int]]:
        layout = w.lineage.layout()
        return {g.slot: WorkerPresence(self._inv, w.index, g.slot) for g in layout.groups}

    def score(
        self, token_ids: Sequence[int], namespace: Namespace | None = None
    ) -> dict[str, int | None]:
        """Predicted reusable tokens of this request on every known worker; None means no
        usable evidence (different from 0)."""
        return self.score_keys(content_keys(token_ids, namespace, self.hash_unit), len(token_ids))

    def score_keys(self, keys: Sequence[int], n_tokens: int) -> dict[str, int | None]:
        """`score` from `content_keys` the caller already computed."""
        plan = self._current_plan()
        result = self._unscored.copy()
        for tokens, bits in score_fast(plan, self._inv.slots, keys, n_tokens, self.hash_unit):
            result.update(zip(self._select(bits), repeat(tokens)))
        for index in plan.fallback:
            name = self._names[index]
            assert name is not None
            w = self._workers[name]
            result[name] = explain_layout(
                w.lineage.layout(), self._presence(w), keys, n_tokens, self.hash_unit
            ).reusable_tokens
        if self._expectations.active:
            for index, credit in self._credit(keys, n_tokens).items():
                name = self._names[index]
                assert name is not None
                current = result[name]
                if current is None or credit > current:
                    result[name] = credit
        return result

    def explain(
        self, token_ids: Sequence[int], namespace: Namespace | None = None
    ) -> dict[str, WorkerScore]:
        """Every worker's score with its per-group breakdown (slower than `score`: one
        worker at a time; for inspection)."""
        keys = content_keys(token_ids, namespace, self.hash_unit)
        return self.explain_keys(keys, len(token_ids))

    def explain_keys(self, keys: Sequence[int], n_tokens: int) -> dict[str, WorkerScore]:
        """`explain` from `content_keys` the caller already computed."""
        credit = self._credit(keys, n_tokens) if self._expectations.active else {}
        out: dict[str, WorkerScore] = {}
        for name, w in self._workers.items():
            ws = explain_layout(
                w.lineage.layout(), self._presence(w), keys, n_tokens, self.hash_unit
            )
            expected = credit.get(w.index, 0)
            if expected and (ws.reusable_tokens is None or expected > ws.reusable_tokens):
                reason = ws.reason + ("; " if ws.reason else "") + "speculative expectation"
                ws = WorkerScore(expected, ws.groups, ws.alignment, reason, expected)
            elif expected:
                ws = WorkerScore(ws.reusable_tokens, ws.groups, ws.alignment, ws.reason, expected)
            out[name] = ws
        return out
