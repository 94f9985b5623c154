"""`FleetIndex`: every worker's view, and scoring that does not grow with the fleet."""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import compress, repeat

from kvroute.indexer.feed import Feed
from kvroute.indexer.fleet_score import full_bounds, score_fast
from kvroute.indexer.group_cache import explain_layout
from kvroute.indexer.inverted import InvertedIndex, WorkerPresence, WorkerSink
from kvroute.indexer.keys import Namespace, content_keys
from kvroute.indexer.layout import Layout, Rule, check_alignment, rule_of
from kvroute.indexer.lineage import Lineage
from kvroute.indexer.plan import Plan, build_plan
from kvroute.indexer.results import WorkerScore, WorkerStats
from kvroute.indexer.speculative import Expectations
from kvroute.proto import events_pb2

_BITS = bytes.maketrans(b"01", b"\x00\x01")


@dataclass(slots=True)
class _Worker:
    worker_id: str
    index: int
    sink: WorkerSink
    feed: Feed
    seen_version: int = -1
    epoch: int = 0  # bumped by every call that changes the view (see apply_snapshot_steps)
    alignment: int | None = None  # the set_alignment override

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
        self._peer_layout: Layout | None = None  # see _expected_layout; set with the plan
        self._expectations = Expectations(max_expectations_per_worker, max_expected_keys)

    # -- workers and events -----------------------------------------------------------------

    def _worker(self, worker_id: str) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None:
            index = self._take_index()
            self._names[index] = worker_id
            sink = WorkerSink(self._inv, index)
            w = _Worker(worker_id, index, sink, Feed(self._lineage(sink)))
            self._workers[worker_id] = w
            self._plan = None
        return w

    def _take_index(self) -> int:
        """A free worker index (its name slot stays None until a worker takes it)."""
        if self._free:
            return heapq.heappop(self._free)
        self._names.append(None)
        return len(self._names) - 1

    def _lineage(self, sink: WorkerSink) -> Lineage:
        return Lineage(sink, self.hash_unit, self._max_entries, self._max_pending)

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
        w.epoch += 1
        w.feed.apply(batch)
        self._view_changed(w)

    def apply_snapshot(self, worker_id: str, snapshot: events_pb2.Snapshot) -> None:
        """Replace the worker's view with a snapshot."""
        w = self._worker(worker_id)
        w.epoch += 1
        w.feed.apply_snapshot(snapshot)
        self._view_changed(w)

    def apply_snapshot_steps(
        self, worker_id: str, snapshot: events_pb2.Snapshot, blocks_per_step: int = 1024
    ) -> Iterator[None]:
        """`apply_snapshot` in bounded steps, for a caller that must keep serving meanwhile
        (a snapshot of 100k blocks takes a fraction of a second at once).

        The new view is built on the side, invisible to scoring, while the worker's current
        view keeps answering; the last build step swaps it in, and the steps after that
        tear the old view down. Each step does about `blocks_per_step` blocks of work, then
        yields (a larger dense STORE is applied in parent-chained parts). Run to its end,
        the result is `apply_snapshot`'s (a STORE contradicting the view in its later
        part, which discards the view, keeps fewer of its blocks). If the view changes
        meanwhile (`apply`, `apply_snapshot`, `invalidate` or `remove_worker` on this
        worker), that later call wins and this snapshot is dropped. Closing the iterator
        early drops the snapshot too, cleaning up at once instead of in steps.
        """
        if blocks_per_step < 1:
            raise ValueError("blocks_per_step must be positive")
        w = self._worker(worker_id)
        w.epoch += 1  # an older build still in steps is dropped: the later snapshot wins
        epoch = w.epoch
        index = self._take_index()
        sink = WorkerSink(self._inv, index)
        lineage = self._lineage(sink)
        if w.alignment is not None:
            lineage.set_alignment(w.alignment)
        teardown: Iterator[None] | None = None
        try:
            # one batch in many calls: lineage records first (positions), then the events
            for placed, chunk in _chunks(snapshot, blocks_per_step):
                if placed:
                    lineage.apply_events((), chunk)
                else:
                    lineage.apply_events(chunk)
                yield
                if self._workers.get(worker_id) is not w or w.epoch != epoch:
                    break
            else:
                lineage.end_batch()
                teardown = self._swap_in(w, index, sink, lineage, snapshot, blocks_per_step)
            if teardown is None:  # dropped: withdraw what was built
                teardown = self._teardown(index, sink, lineage, blocks_per_step)
            for _ in teardown:  # not `yield from`: closing us must not close it
                yield
        finally:
            if teardown is None:
                teardown = self._teardown(index, sink, lineage, blocks_per_step)
            for _ in teardown:  # closed early: finish at once
                pass

    def _swap_in(
        self,
        w: _Worker,
        index: int,
        sink: WorkerSink,
        lineage: Lineage,
        snapshot: events_pb2.Snapshot,
        blocks_per_step: int,
    ) -> Iterator[None]:
        """Make the view built at `index` the worker's; returns the old view's teardown."""
        old_index, old_sink = w.index, w.sink
        lineage.set_alignment(w.alignment)  # it may have changed during the build
        old_lineage = w.feed.adopt_snapshot(lineage, snapshot)
        w.index, w.sink = index, sink
        self._names[index] = w.worker_id
        self._names[old_index] = None
        self._expectations.move(old_index, index)
        w.epoch += 1
        w.seen_version = -1
        self._plan = None
        self._view_changed(w)
        return self._teardown(old_index, old_sink, old_lineage, blocks_per_step)

    def _teardown(
        self, index: int, sink: WorkerSink, lineage: Lineage, keys_per_step: int
    ) -> Iterator[None]:
        """Withdraw a detached view from the inverted index in steps, then free its index."""
        keys = list(lineage.keys())
        for start in range(0, len(keys), keys_per_step):
            if start:
                yield
            for key in keys[start : start + keys_per_step]:
                sink.drop(key)
        heapq.heappush(self._free, index)

    def invalidate(self, worker_id: str) -> None:
        """The worker's stream was lost: no score (None) until new evidence."""
        w = self._worker(worker_id)
        w.epoch += 1
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
        w.alignment = alignment
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
        keys = content_keys(token_ids, namespace, self.hash_unit)
        self.expect_keys(worker_id, keys, len(token_ids), expires_at)

    def expect_keys(
        self,
        worker_id: str,
        keys: Sequence[int],
        n_tokens: int,
        expires_at: float,
        junction: int = 0,
    ) -> None:
        """`expect` from `content_keys` the caller already computed (for `score_keys`).
        `junction`: the worker's full-attention coverage of the prompt when it exceeded the
        reuse (`reach_keys`), where vLLM will save sparse state for requests sharing it (at
        `Layout.junction_state`: a Mamba group keeps it at the block ending there)."""
        w = self._worker(worker_id)
        layout = self._expected_layout(w)
        alignment = layout.alignment if layout.usable else self.hash_unit
        if layout.usable:
            junction = layout.junction_state(junction)
        self._expectations.add(
            w.index, keys, n_tokens, alignment, self.hash_unit, expires_at, junction
        )

    def expire(self, now: float) -> None:
        """Drop expectations with expires_at <= now."""
        self._expectations.expire(now)

    def _credit(self, keys: Sequence[int], n_tokens: int) -> dict[int, int]:
        return self._expectations.credit(keys, n_tokens - 1, self.hash_unit, self._rule_of)

    def _expected_layout(self, w: _Worker) -> Layout:
        """The layout that judges what `w` will hold of the prompts expected there: its own
        once its events report any group; before that (a worker just started, restarted,
        or idle since the index began) the one layout every worker reporting groups shares.

        Workers behind one router serve one model, and a burst's first prompt tends to go
        to exactly such an idle worker: judged as unknown, the prefix it will hold earns
        no junction credit there, and the burst's next request re-prefills it elsewhere.
        Workers of different layouts (several models, a rolling upgrade) lend nothing."""
        layout = w.lineage.layout()
        if layout.groups:
            return layout
        self._current_plan()  # sets _peer_layout
        return self._peer_layout or layout

    def _rule_of(self, index: int) -> tuple[bool, int]:
        """(all groups full attention, alignment) of a worker, for speculative credit."""
        name = self._names[index]
        assert name is not None
        layout = self._expected_layout(self._workers[name])
        if not layout.usable:
            return False, self.hash_unit
        return all(u.rule is Rule.FULL for u in layout.units), layout.alignment

    def _junctions(self, name: str) -> bool:
        """Whether the worker's layout (`_expected_layout`) has full attention and
        sliding-window or Mamba groups: the layout where serving a prefix full attention
        holds saves a junction (the workers `reach_keys` reports coverage for)."""
        layout = self._expected_layout(self._workers[name])
        rules = {u.rule for u in layout.units}  # no units when the layout is unusable
        return Rule.FULL in rules and len(rules) > 1

    # -- scoring ---------------------------------------------------------------------------

    def _current_plan(self) -> Plan:
        if self._plan is None:
            plan = build_plan({w.index: w.lineage.layout() for w in self._workers.values()})
            self._peer_layout = _shared_layout(w.lineage.layout() for w in self._workers.values())
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
        return self._score(keys, n_tokens, None)

    def reach_keys(
        self, keys: Sequence[int], n_tokens: int
    ) -> tuple[dict[str, int | None], dict[str, int]]:
        """`score_keys`, and for each worker with sliding-window or Mamba groups the prompt
        tokens its full-attention groups hold (speculative credit included).

        That coverage bounds the reuse; where it exceeds it, vLLM saves sliding-window and
        Mamba state at its end when it serves the request (a shared-prefix junction), so
        later requests sharing that prefix reuse it there. Workers with only full attention
        (coverage = reuse) or none are absent from the second map. Costs nothing extra on
        the bitset path: scoring walks the full-attention coverage anyway."""
        coverage: dict[str, int] = {}
        return self._score(keys, n_tokens, coverage), coverage

    def _score(
        self, keys: Sequence[int], n_tokens: int, coverage: dict[str, int] | None
    ) -> dict[str, int | None]:
        plan = self._current_plan()
        result = self._unscored.copy()
        slots = self._inv.slots
        bounds = None
        sparse = plan.sparse_mask & ~plan.nofull_mask
        if coverage is not None and sparse:
            coverage.update(zip(self._select(sparse), repeat(0)))
        if coverage is not None and sparse and n_tokens > 1:
            bounds = full_bounds(plan, slots, keys, n_tokens - 1, self.hash_unit)
            for tokens, bits in bounds:
                if bits & sparse:
                    coverage.update(zip(self._select(bits & sparse), repeat(tokens)))
        for tokens, bits in score_fast(plan, slots, keys, n_tokens, self.hash_unit, bounds):
            result.update(zip(self._select(bits), repeat(tokens)))
        for index in plan.fallback:
            name = self._names[index]
            assert name is not None
            w = self._workers[name]
            layout = w.lineage.layout()
            ws = explain_layout(layout, self._presence(w), keys, n_tokens, self.hash_unit)
            result[name] = ws.reusable_tokens
            if coverage is not None and any(u.rule is not Rule.FULL for u in layout.units):
                full = [
                    g.accepted_tokens
                    for g in ws.groups
                    if rule_of(g.kind, g.sliding_window) is Rule.FULL
                    and g.accepted_tokens is not None
                ]
                if full:
                    coverage[name] = min(full)
        if self._expectations.active:
            reach = self._expectations.reach(keys, n_tokens - 1, self.hash_unit)
            credits = self._expectations.credit_from_reach(
                reach, keys, self.hash_unit, self._rule_of
            )
            for index, credit in credits.items():
                name = self._names[index]
                assert name is not None
                current = result[name]
                if current is None or credit > current:
                    result[name] = credit
            if coverage is not None:
                for index, units in reach.items():
                    name = self._names[index]
                    assert name is not None
                    # only where the events show full attention beside sparse groups: a
                    # worker of unknown layout may be dense, and then these tokens are
                    # reuse at once, not a junction (its credit stays the cautious one)
                    if self._junctions(name) and units * self.hash_unit > coverage.get(name, 0):
                        coverage[name] = units * self.hash_unit
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


def _shared_layout(layouts: Iterable[Layout]) -> Layout | None:
    """The layout of every worker that reports groups, if they all have one usable shape."""
    found: Layout | None = None
    for layout in layouts:
        if not layout.groups:
            continue
        if not layout.usable or (found is not None and layout.shape() != found.shape()):
            return None
        found = found or layout
    return found


def _chunks(
    snapshot: events_pb2.Snapshot, blocks: int
) -> Iterator[tuple[bool, list[events_pb2.KvGroupEvent]]]:
    """The snapshot's lineage records (True), then its events (False), in consecutive runs
    of about `blocks` blocks each (an event counts at least one: declarations and sparse
    stores cost something too); a larger dense STORE is cut into parts first."""
    for placed, events in ((True, snapshot.lineage), (False, snapshot.events)):
        chunk: list[events_pb2.KvGroupEvent] = []
        size = 0
        for whole in events:
            for event in _parts(whole, blocks):
                chunk.append(event)
                size += max(1, len(event.block_hashes))
                if size >= blocks:
                    yield placed, chunk
                    chunk, size = [], 0
        if chunk:
            yield placed, chunk


_SPLITTABLE = frozenset(
    {"operation", "group_id", "block_hashes", "parent_block_hash", "token_ids", "block_size",
     "kind", "sliding_window", "lora_name", "cache_namespace", "unmatchable"}
)  # fmt: skip


def _parts(event: events_pb2.KvGroupEvent, blocks: int) -> Iterator[events_pb2.KvGroupEvent]:
    """A well-formed dense STORE of more than `blocks` blocks as consecutive STOREs, each
    the child of the previous one's last block (the salt only at the first, as vLLM
    publishes it): the same blocks, keys and namespaces. Anything else as it is."""
    hashes = event.block_hashes
    n = len(hashes)
    bs = event.block_size
    if (
        n <= blocks
        or event.operation != events_pb2.KvGroupEvent.STORE
        or bs <= 0
        or len(event.token_ids) != n * bs
        or not all(hashes)
        or any(field.name not in _SPLITTABLE for field, _ in event.ListFields())
    ):
        yield event
        return
    tokens = event.token_ids
    parent = event.parent_block_hash
    salt = event.cache_namespace
    for start in range(0, n, blocks):
        stop = min(n, start + blocks)
        yield events_pb2.KvGroupEvent(
            operation=event.operation,
            group_id=event.group_id,
            block_hashes=hashes[start:stop],
            parent_block_hash=parent,
            token_ids=tokens[start * bs : stop * bs],
            block_size=bs,
            kind=event.kind,
            sliding_window=event.sliding_window,
            lora_name=event.lora_name,
            cache_namespace=salt,
            unmatchable=event.unmatchable,
        )
        parent = hashes[stop - 1]
        salt = ""
