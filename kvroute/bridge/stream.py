"""One engine rank's event stream as subscribers see it: state, recent batches, fan-out.

All methods run on the bridge's event loop (no locks): the follower calls `apply` and
`reset`; the gRPC servicer calls `subscribe` / `unsubscribe` and reads subscriber queues.

- Every response is serialized once (`SubscribeResponse` bytes) and shared by subscribers.
- Each subscriber has a bounded queue. A subscriber whose queue is full is resynchronised: its
  queue is emptied and it waits for a snapshot (reason "lagging"). The others never wait for it.
- A bounded ring of recent batches lets a subscriber resume by (stream_id, after_sequence).
- `stream_id` changes whenever the view restarts (bridge start, or any reset), so a resume
  across a reset always gets a snapshot.

Snapshots never hold up the engine's batches. A large state's snapshot is built by a task of
the stream's own in bounded steps (`EngineState.snapshot_steps`) while the state stays
frozen: batches arriving meanwhile go to subscribers at once and wait (`pending`, at most
`queue_size`) to be applied to the state after the build. A snapshot reflects one version of
the stream (a count of applied batches and resets); a subscriber waiting for one gets it,
then the ring's batches after that version, and joins the live fan-out in the same step, so
it misses and repeats nothing. One build serves every waiting subscriber, and later ones
while the ring still holds the batches since; `SnapshotBuilds` caps the builds running at
once over all ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Final

from kvroute.bridge.convert import TIER_NAMES
from kvroute.bridge.groups import TierGroups, amend
from kvroute.bridge.metrics import BridgeMetrics
from kvroute.bridge.state import EngineState, SnapshotPieces
from kvroute.proto.events_pb2 import (
    KvEventBatch,
    KvGroupEvent,
    Snapshot,
    SubscribeRequest,
    SubscribeResponse,
    Tier,
)

log = logging.getLogger(__name__)

DEFAULT_QUEUE_SIZE: Final = 1024
DEFAULT_RING_BATCHES: Final = 4096
DEFAULT_RING_BYTES: Final = 64 << 20
DEFAULT_MAX_SNAPSHOT_BUILDS: Final = 2
# A snapshot of at most this many blocks is built at once (about a millisecond); larger
# ones in steps of about _STEP_S each, between which the loop serves the engine's batches.
_SYNC_BUILD_BLOCKS: Final = 512
_STEP_S: Final = 0.002

_KINDS: Final = {
    KvGroupEvent.STORE: "store",
    KvGroupEvent.REMOVE: "remove",
    KvGroupEvent.CLEAR: "clear",
    KvGroupEvent.INVALID: "invalid",
}


def _count_tiers(m: BridgeMetrics, label: str, batch: KvEventBatch) -> None:
    """Count a batch's events per tier and kind (one label lookup per pair)."""
    counts: Counter[tuple[Tier.ValueType, KvGroupEvent.Operation.ValueType]] = Counter(
        (event.tier, event.operation) for event in batch.tier_events
    )
    counts.update((Tier.GPU, event.operation) for event in batch.events)
    for (tier, op), count in counts.items():
        name = TIER_NAMES.get(tier)
        if name is not None:
            m.tier_events.labels(label, name, _KINDS.get(op, "invalid")).inc(count)


@dataclass(frozen=True)
class StreamLimits:
    """Bounds of a rank stream."""

    # Messages per subscriber; also the batches a snapshot build may fall behind by (a
    # snapshot followed by more missed batches could not be queued).
    queue_size: int = DEFAULT_QUEUE_SIZE
    ring_batches: int = DEFAULT_RING_BATCHES  # recent batches kept for resume
    ring_bytes: int = DEFAULT_RING_BYTES


class Subscriber:
    """One gRPC subscriber: a bounded queue of serialized `SubscribeResponse`s."""

    def __init__(self, queue_size: int) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=queue_size)

    def offer(self, message: bytes) -> bool:
        """Queue a message; False if the queue is full (the caller resynchronises)."""
        try:
            self.queue.put_nowait(message)
        except asyncio.QueueFull:
            return False
        return True

    def clear(self) -> None:
        """Drop everything queued (a snapshot replaces it)."""
        while not self.queue.empty():
            self.queue.get_nowait()


class SnapshotBuilds:
    """The cap on snapshot builds running at once over all of a bridge's rank streams."""

    def __init__(
        self, limit: int = DEFAULT_MAX_SNAPSHOT_BUILDS, metrics: BridgeMetrics | None = None
    ) -> None:
        if limit < 1:
            raise ValueError("at least one snapshot build must be allowed")
        self.limit = limit
        self.running = 0
        self.peak = 0  # most builds seen running at once
        self._slots = asyncio.Semaphore(limit)
        self._metrics = metrics

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one of the `limit` build slots (waiting for one if all are taken)."""
        async with self._slots:
            self._count(1)
            try:
                yield
            finally:
                self._count(-1)

    def _count(self, change: int) -> None:
        self.running += change
        self.peak = max(self.peak, self.running)
        if self._metrics is not None:
            self._metrics.snapshot_builds_running.set(self.running)


@dataclass
class _Built:
    """A built snapshot: the state at stream version `version`, serialized without reason."""

    stream_id: str
    version: int
    body: bytes
    by_reason: dict[str, bytes] = field(default_factory=dict)

    def message(self, reason: str) -> bytes:
        """The `SubscribeResponse` bytes with `reason` (a serialized reason merges in)."""
        message = self.by_reason.get(reason)
        if message is None:
            head = SubscribeResponse(snapshot=Snapshot(reason=reason)).SerializeToString()
            message = self.by_reason[reason] = head + self.body
        return message


class RankStream:
    """The event stream of one engine DP rank."""

    def __init__(
        self,
        dp_rank: int,
        bridge_id: str,
        state: EngineState,
        metrics: BridgeMetrics,
        limits: StreamLimits = StreamLimits(),
        builds: SnapshotBuilds | None = None,
    ) -> None:
        self.dp_rank = dp_rank
        self.state = state
        self.limits = limits
        self._bridge_id = bridge_id
        self._epoch = 0
        self.stream_id = self._make_stream_id()
        self._metrics = metrics
        self._label = str(dp_rank)
        self._builds = builds if builds is not None else SnapshotBuilds(metrics=metrics)
        # Groups and sequence as sent: the state may be behind (see the module docstring).
        self._groups = TierGroups(state.max_groups)
        self.last_sequence: int | None = state.last_sequence
        self._subscribers: set[Subscriber] = set()  # following the live batches
        self._waiting: dict[Subscriber, str] = {}  # waiting for a snapshot -> its reason
        self._ring: deque[tuple[int, int, bytes]] = deque()  # (version, sequence, message)
        self._ring_bytes = 0
        self._version = 0  # bumped by every batch and reset
        self._state_version = 0  # the version the state reflects
        self._pending: deque[tuple[int, KvEventBatch]] = deque()  # not yet in the state
        self._frozen = False  # a build is reading the state
        self._built: _Built | None = None
        self._worker: asyncio.Task[None] | None = None

    def _make_stream_id(self) -> str:
        return f"{self._bridge_id}/{self.dp_rank}/{self._epoch}"

    @property
    def subscriber_count(self) -> int:
        """Connected subscribers (following, or waiting for their snapshot)."""
        return len(self._subscribers) + len(self._waiting)

    # -- producer side (the follower) -----------------------------------------------------

    def apply(self, batch: KvEventBatch) -> None:
        """Send one converted engine batch to every subscriber and apply it to the state
        (later, if a snapshot is being built)."""
        sent = amend(self._groups, batch)
        self._version += 1
        self.last_sequence = sent.sequence
        m, label = self._metrics, self._label
        m.batches.labels(label).inc()
        for event in sent.events:
            m.events.labels(label, _KINDS.get(event.operation, "invalid")).inc()
        _count_tiers(m, label, sent)
        m.last_sequence.labels(label).set(sent.sequence)
        message = SubscribeResponse(batch=sent).SerializeToString()
        self._remember(sent.sequence, message)
        for subscriber in list(self._subscribers):
            if not subscriber.offer(message):
                m.lagging_subscribers.labels(label).inc()
                self._subscribers.discard(subscriber)
                subscriber.clear()
                self._wait(subscriber, "lagging")
        if not self._frozen and not self._pending:
            self._apply_to_state(self._version, sent)
            return
        self._pending.append((self._version, sent))
        if len(self._pending) >= self.limits.queue_size:
            # A snapshot this far behind could not be queued with the batches it missed:
            # give the build up and keep the state within the bound.
            if self._frozen:
                self._stop_worker()
                m.snapshot_builds_abandoned.labels(label, "behind").inc()
            self._apply_to_state(*self._pending.popleft())
            self._kick()
        m.pending_batches.labels(label).set(len(self._pending))

    def _apply_to_state(self, version: int, batch: KvEventBatch) -> None:
        stats = self.state.stats
        before_invalid = stats.invalid_resets
        before_unknown = stats.unknown_removes
        before_evicted = stats.evicted_blocks
        before_lineage = stats.evicted_lineage_blocks
        self.state.apply(batch)  # already amended: the state sends the same batch
        self._state_version = version
        m, label = self._metrics, self._label
        m.unknown_removes.labels(label).inc(stats.unknown_removes - before_unknown)
        m.evicted_blocks.labels(label).inc(stats.evicted_blocks - before_evicted)
        m.evicted_lineage_blocks.labels(label).inc(stats.evicted_lineage_blocks - before_lineage)
        m.state_blocks.labels(label).set(self.state.blocks)
        m.tier_blocks.labels(label, TIER_NAMES[Tier.GPU]).set(self.state.blocks)
        for tier, view in self.state.tiers.items():
            m.tier_blocks.labels(label, TIER_NAMES[tier]).set(view.blocks)
        m.lineage_blocks.labels(label).set(self.state.lineage_blocks)
        if stats.invalid_resets != before_invalid:
            m.resets.labels(label, "invalid_event").inc()

    def reset(self, reason: str, sequence: int | None = None) -> None:
        """Forget the engine's cache (a new stream_id); subscribers get an empty snapshot.

        `sequence` is the engine sequence the empty view reflects, if known.
        """
        if self._frozen:
            self._metrics.snapshot_builds_abandoned.labels(self._label, "reset").inc()
        self._stop_worker()
        self._pending.clear()
        self.state.reset()
        self.state.last_sequence = sequence
        self._groups.clear()
        self.last_sequence = sequence
        self._epoch += 1
        self.stream_id = self._make_stream_id()
        self._version += 1
        self._state_version = self._version
        self._built = None
        self._ring.clear()
        self._ring_bytes = 0
        m, label = self._metrics, self._label
        m.resets.labels(label, reason).inc()
        m.state_blocks.labels(label).set(0)
        m.pending_batches.labels(label).set(0)
        for subscriber in self._subscribers:
            self._waiting[subscriber] = reason
        self._subscribers.clear()
        for subscriber in self._waiting:
            self._waiting[subscriber] = reason
            subscriber.clear()
        if self._waiting:
            self._build_now()  # an empty state: at once

    def _remember(self, sequence: int, message: bytes) -> None:
        ring = self._ring
        ring.append((self._version, sequence, message))
        self._ring_bytes += len(message)
        limits = self.limits
        while ring and (len(ring) > limits.ring_batches or self._ring_bytes > limits.ring_bytes):
            self._ring_bytes -= len(ring.popleft()[2])

    # -- consumer side (the gRPC servicer) ------------------------------------------------

    def subscribe(self, request: SubscribeRequest) -> Subscriber:
        """Register a subscriber and queue what it needs first: the batches it missed (when
        resuming within the ring), or a snapshot (at once, or when it is built)."""
        subscriber = Subscriber(self.limits.queue_size)
        missed = self._missed_since(request) if request.resume else None
        if missed is None:
            self._wait(subscriber, "resume_unavailable" if request.resume else "initial")
        elif len(missed) > self.limits.queue_size:
            self._metrics.resumes.labels(self._label).inc()
            self._wait(subscriber, "lagging")
        else:
            self._metrics.resumes.labels(self._label).inc()
            for message in missed:
                subscriber.offer(message)
            self._subscribers.add(subscriber)
        self._metrics.subscribers.labels(self._label).set(self.subscriber_count)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        """Forget a subscriber that went away."""
        self._subscribers.discard(subscriber)
        self._waiting.pop(subscriber, None)
        self._metrics.subscribers.labels(self._label).set(self.subscriber_count)

    def _missed_since(self, request: SubscribeRequest) -> list[bytes] | None:
        """The ring's batches after `after_sequence`, or None if they cannot be served."""
        if request.stream_id != self.stream_id:
            return None
        last = self.last_sequence
        after = request.after_sequence
        if last is None or after > last:
            return None
        if after == last:
            return []
        ring = self._ring
        if not ring or ring[0][1] > after + 1:
            return None
        return [message for _, sequence, message in ring if sequence > after]

    # -- snapshots ------------------------------------------------------------------------

    def _wait(self, subscriber: Subscriber, reason: str) -> None:
        """Let `subscriber` wait for a snapshot: the last one built if it can still be
        caught up, else a new one (at once for a small state)."""
        self._waiting[subscriber] = reason
        small = self.state.blocks + self.state.lineage_blocks <= _SYNC_BUILD_BLOCKS
        if small and not self._frozen and not self._pending:
            self._build_now()  # a fresh one costs next to nothing
        elif not self._serve(subscriber, reason):
            self._kick()

    def _serve(self, subscriber: Subscriber, reason: str) -> bool:
        """Queue the last snapshot and the batches after it for a waiting subscriber, which
        then follows the live batches; False if that snapshot cannot be caught up."""
        built = self._built
        if built is None or built.stream_id != self.stream_id:
            return False
        missed = self._ring_after(built.version)
        if missed is None or len(missed) >= self.limits.queue_size:
            return False
        subscriber.clear()
        subscriber.offer(built.message(reason))
        for message in missed:
            subscriber.offer(message)
        del self._waiting[subscriber]
        self._subscribers.add(subscriber)
        self._metrics.snapshots.labels(self._label, reason).inc()
        return True

    def _serve_waiting(self) -> None:
        for subscriber, reason in list(self._waiting.items()):
            self._serve(subscriber, reason)

    def _ring_after(self, version: int) -> list[bytes] | None:
        """The ring's messages after stream version `version`; None if it lost some."""
        if version == self._version:
            return []
        ring = self._ring
        if not ring or ring[0][0] > version + 1:
            return None
        return [message for at, _, message in ring if at > version]

    def _build_now(self) -> None:
        """Build a (small) snapshot of the current state in one piece, unless the last one
        is of it, and serve it."""
        built = self._built
        if built is None or (built.stream_id, built.version) != (
            self.stream_id,
            self._state_version,
        ):
            out = SnapshotPieces()
            for _ in self.state.snapshot_steps(out, stream_id=self.stream_id):
                pass
            self._built = self._finish(out, self._state_version)
        self._serve_waiting()

    def _finish(self, out: SnapshotPieces, version: int) -> _Built:
        built = _Built(self.stream_id, version, b"".join(out.pieces))
        m, label = self._metrics, self._label
        m.snapshot_builds.labels(label).inc()
        m.snapshot_events.labels(label).observe(out.events)
        m.snapshot_bytes.labels(label).observe(len(built.body))
        return built

    def _kick(self) -> None:
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._work())

    def _stop_worker(self) -> None:
        """Give up the build or catch-up in progress (the state is no longer read)."""
        if self._worker is not None:
            self._worker.cancel()
            self._worker = None
        self._frozen = False

    async def _work(self) -> None:
        """Apply pending batches to the state and build snapshots for waiting subscribers,
        in steps, until there is nothing left to do."""
        me = asyncio.current_task()
        try:
            while True:
                if self._pending:
                    self._catch_up_step()
                    await asyncio.sleep(0)
                    continue
                self._serve_waiting()
                if not self._waiting:
                    return
                async with self._builds.slot():
                    if self._pending or not self._waiting:
                        continue  # changed while waiting for a slot
                    built = await self._build_in_steps()
                self._built = built
                self._serve_waiting()
        except Exception:  # a bug must not freeze the state for good
            log.exception("rank %s: snapshot build failed", self._label)
            if self._worker is me:
                self._frozen = False
        finally:
            if self._worker is me:
                self._worker = None

    def _catch_up_step(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _STEP_S
        self._apply_to_state(*self._pending.popleft())  # progress whatever the clock says
        while self._pending and loop.time() < deadline:
            self._apply_to_state(*self._pending.popleft())
        self._metrics.pending_batches.labels(self._label).set(len(self._pending))

    async def _build_in_steps(self) -> _Built:
        loop = asyncio.get_running_loop()
        version = self._state_version
        out = SnapshotPieces()
        self._frozen = True
        started = step = loop.time()
        for _ in self.state.snapshot_steps(out, stream_id=self.stream_id):
            if loop.time() - step >= _STEP_S:
                await asyncio.sleep(0)  # the follower's batches go first
                step = loop.time()
        self._frozen = False
        self._metrics.snapshot_build_seconds.labels(self._label).observe(loop.time() - started)
        return self._finish(out, version)
