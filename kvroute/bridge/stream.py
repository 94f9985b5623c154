"""One engine rank's event stream as subscribers see it: state, recent batches, fan-out.

All methods run on the bridge's event loop (no locks): the follower calls `apply` and
`reset`; the gRPC servicer calls `subscribe` / `unsubscribe` and reads subscriber queues.

- Every response is serialized once (`SubscribeResponse` bytes) and shared by subscribers.
- Each subscriber has a bounded queue. A subscriber whose queue is full is resynchronised: its
  queue is replaced by one snapshot of the current state (reason "lagging"). The others never
  wait for it.
- A bounded ring of recent batches lets a subscriber resume by (stream_id, after_sequence).
- `stream_id` changes whenever the view restarts (bridge start, or any reset), so a resume
  across a reset always gets a snapshot.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from dataclasses import dataclass
from typing import Final

from kvroute.bridge.convert import TIER_NAMES
from kvroute.bridge.metrics import BridgeMetrics
from kvroute.bridge.state import EngineState
from kvroute.proto.events_pb2 import (
    KvEventBatch,
    KvGroupEvent,
    SubscribeRequest,
    SubscribeResponse,
    Tier,
)

log = logging.getLogger(__name__)

DEFAULT_QUEUE_SIZE: Final = 1024
DEFAULT_RING_BATCHES: Final = 4096
DEFAULT_RING_BYTES: Final = 64 << 20

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

    queue_size: int = DEFAULT_QUEUE_SIZE  # messages per subscriber
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

    def replace_with(self, message: bytes) -> None:
        """Drop everything queued and queue `message` alone (a snapshot)."""
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(message)


class RankStream:
    """The event stream of one engine DP rank."""

    def __init__(
        self,
        dp_rank: int,
        bridge_id: str,
        state: EngineState,
        metrics: BridgeMetrics,
        limits: StreamLimits = StreamLimits(),
    ) -> None:
        self.dp_rank = dp_rank
        self.state = state
        self.limits = limits
        self._bridge_id = bridge_id
        self._epoch = 0
        self.stream_id = self._make_stream_id()
        self._metrics = metrics
        self._label = str(dp_rank)
        self._subscribers: set[Subscriber] = set()
        self._ring: deque[tuple[int, bytes]] = deque()
        self._ring_bytes = 0
        self._snapshot_cache: tuple[tuple[str, int, int | None, str], bytes] | None = None
        self._version = 0  # bumped on every change of state

    def _make_stream_id(self) -> str:
        return f"{self._bridge_id}/{self.dp_rank}/{self._epoch}"

    @property
    def subscriber_count(self) -> int:
        """Connected subscribers."""
        return len(self._subscribers)

    # -- producer side (the follower) -----------------------------------------------------

    def apply(self, batch: KvEventBatch) -> None:
        """Apply one converted engine batch and send it to every subscriber."""
        before_invalid = self.state.stats.invalid_resets
        before_unknown = self.state.stats.unknown_removes
        before_evicted = self.state.stats.evicted_blocks
        before_lineage = self.state.stats.evicted_lineage_blocks
        sent = self.state.apply(batch)
        self._version += 1
        self._snapshot_cache = None
        m, label = self._metrics, self._label
        m.batches.labels(label).inc()
        for event in sent.events:
            m.events.labels(label, _KINDS.get(event.operation, "invalid")).inc()
        _count_tiers(m, label, sent)
        m.unknown_removes.labels(label).inc(self.state.stats.unknown_removes - before_unknown)
        m.evicted_blocks.labels(label).inc(self.state.stats.evicted_blocks - before_evicted)
        m.evicted_lineage_blocks.labels(label).inc(
            self.state.stats.evicted_lineage_blocks - before_lineage
        )
        m.state_blocks.labels(label).set(self.state.blocks)
        m.tier_blocks.labels(label, TIER_NAMES[Tier.GPU]).set(self.state.blocks)
        for tier, view in self.state.tiers.items():
            m.tier_blocks.labels(label, TIER_NAMES[tier]).set(view.blocks)
        m.lineage_blocks.labels(label).set(self.state.lineage_blocks)
        m.last_sequence.labels(label).set(sent.sequence)
        if self.state.stats.invalid_resets != before_invalid:
            m.resets.labels(label, "invalid_event").inc()
        message = SubscribeResponse(batch=sent).SerializeToString()
        self._remember(sent.sequence, message)
        for subscriber in list(self._subscribers):
            if not subscriber.offer(message):
                m.lagging_subscribers.labels(label).inc()
                subscriber.replace_with(self._snapshot("lagging"))

    def reset(self, reason: str, sequence: int | None = None) -> None:
        """Forget the engine's cache (a new stream_id); subscribers get an empty snapshot.

        `sequence` is the engine sequence the empty view reflects, if known.
        """
        self.state.reset()
        self.state.last_sequence = sequence
        self._epoch += 1
        self.stream_id = self._make_stream_id()
        self._version += 1
        self._snapshot_cache = None
        self._ring.clear()
        self._ring_bytes = 0
        self._metrics.resets.labels(self._label, reason).inc()
        self._metrics.state_blocks.labels(self._label).set(0)
        if not self._subscribers:
            return
        message = self._snapshot(reason)
        for subscriber in list(self._subscribers):
            subscriber.replace_with(message)

    def _remember(self, sequence: int, message: bytes) -> None:
        ring = self._ring
        ring.append((sequence, message))
        self._ring_bytes += len(message)
        limits = self.limits
        while ring and (len(ring) > limits.ring_batches or self._ring_bytes > limits.ring_bytes):
            self._ring_bytes -= len(ring.popleft()[1])

    # -- consumer side (the gRPC servicer) ------------------------------------------------

    def subscribe(self, request: SubscribeRequest) -> Subscriber:
        """Register a subscriber and queue what it needs first: the batches it missed (when
        resuming within the ring) or a snapshot."""
        subscriber = Subscriber(self.limits.queue_size)
        missed = self._missed_since(request) if request.resume else None
        if missed is None:
            reason = "resume_unavailable" if request.resume else "initial"
            subscriber.offer(self._snapshot(reason))
        else:
            self._metrics.resumes.labels(self._label).inc()
            for message in missed[-self.limits.queue_size :]:
                subscriber.offer(message)
            if len(missed) > self.limits.queue_size:
                subscriber.replace_with(self._snapshot("lagging"))
        self._subscribers.add(subscriber)
        self._metrics.subscribers.labels(self._label).set(len(self._subscribers))
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        """Forget a subscriber that went away."""
        self._subscribers.discard(subscriber)
        self._metrics.subscribers.labels(self._label).set(len(self._subscribers))

    def _missed_since(self, request: SubscribeRequest) -> list[bytes] | None:
        """The ring's batches after `after_sequence`, or None if they cannot be served."""
        if request.stream_id != self.stream_id:
            return None
        last = self.state.last_sequence
        after = request.after_sequence
        if last is None or after > last:
            return None
        if after == last:
            return []
        ring = self._ring
        if not ring or ring[0][0] > after + 1:
            return None
        return [message for sequence, message in ring if sequence > after]

    def _snapshot(self, reason: str) -> bytes:
        key = (self.stream_id, self._version, self.state.last_sequence, reason)
        if self._snapshot_cache is not None and self._snapshot_cache[0] == key:
            message = self._snapshot_cache[1]
        else:
            snapshot = self.state.snapshot(stream_id=self.stream_id, reason=reason)
            message = SubscribeResponse(snapshot=snapshot).SerializeToString()
            self._snapshot_cache = (key, message)
            self._metrics.snapshot_events.labels(self._label).observe(len(snapshot.events))
            self._metrics.snapshot_bytes.labels(self._label).observe(len(message))
        self._metrics.snapshots.labels(self._label, reason).inc()
        return message
