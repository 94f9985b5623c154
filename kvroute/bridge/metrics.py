"""The bridge's Prometheus metrics (one registry per bridge instance, no globals)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "BridgeMetrics"]

_PREFIX = "kvroute_bridge_"
_RANK = ("dp_rank",)


class BridgeMetrics:
    """Counters and gauges, all labelled by the engine's DP rank (some by one more label)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(_PREFIX + name, doc, (*_RANK, *labels), registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(_PREFIX + name, doc, _RANK, registry=r)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(_PREFIX + name, doc, _RANK, buckets=buckets, registry=r)

        # The engine stream.
        self.batches = counter("batches", "Engine batches applied (live or replayed)")
        self.events = counter(
            "events", "Converted events by kind (store, remove, clear, invalid, filtered)", "kind"
        )
        self.tier_events = counter(
            "tier_events",
            "Events per KV tier (gpu, cpu, storage) by kind (store, remove, clear, invalid, "
            "placeholder: a lower-tier store without tokens, dropped)",
            "tier",
            "kind",
        )
        self.stored_blocks = counter("stored_blocks", "Block hashes in converted stores")
        self.gaps = counter("gaps", "Sequence gaps seen on the live stream")
        self.replays = counter(
            "replays",
            "Replay requests by outcome (recovered, unrecoverable, timeout, unavailable)",
            "outcome",
        )
        self.replayed_batches = counter("replayed_batches", "Batches received from replay")
        self.resets = counter(
            "resets", "View resets by reason (gap, restart, malformed, reconnect, ...)", "reason"
        )
        self.malformed = counter(
            "malformed_frames", "Malformed messages by problem (frames, seq, payload)", "problem"
        )
        self.unknown_fields = counter(
            "unknown_field_batches", "Batches with fields this bridge does not know (ignored)"
        )
        self.unknown_removes = counter(
            "unknown_removes", "Removals of blocks the bridge did not hold"
        )
        self.follower_restarts = counter(
            "follower_restarts", "Times the engine follower failed and was restarted"
        )
        self.last_sequence = gauge("last_sequence", "Last engine sequence applied")
        self.engine_connected = gauge(
            "engine_connected", "1 while the engine's PUB socket is connected"
        )
        self.lag = histogram(
            "lag_seconds",
            "Time from the engine's batch timestamp to its conversion by the bridge",
            (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
        )
        # The snapshot state.
        self.evicted_blocks = counter(
            "state_evicted_blocks", "Blocks dropped from the snapshot state at its bound"
        )
        self.state_blocks = gauge("state_blocks", "Live block copies in the snapshot state")
        self.tier_blocks = Gauge(
            _PREFIX + "state_tier_blocks",
            "Live block copies in the snapshot state per KV tier (gpu, cpu, storage)",
            (*_RANK, "tier"),
            registry=r,
        )
        self.evicted_lineage_blocks = counter(
            "state_evicted_lineage_blocks",
            "Lineage-only blocks (ancestors of live blocks) dropped at their bound",
        )
        self.lineage_blocks = gauge(
            "state_lineage_blocks",
            "Blocks kept only to place live blocks in snapshots (their ancestors)",
        )
        # Subscribers.
        self.subscribers = gauge("subscribers", "Connected gRPC subscribers")
        self.snapshots = counter(
            "snapshots_sent",
            "Snapshots sent to subscribers by reason (initial, lagging, reset, ...)",
            "reason",
        )
        self.snapshot_events = histogram(
            "snapshot_events",
            "Events per snapshot built",
            (1, 10, 100, 1_000, 10_000, 100_000, 1_000_000),
        )
        self.snapshot_bytes = histogram(
            "snapshot_bytes",
            "Serialized size of each snapshot built",
            (1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9),
        )
        self.lagging_subscribers = counter(
            "lagging_subscribers",
            "Times a subscriber fell behind its queue bound and was resynchronised",
        )
        # Not per rank: a refused caller's requested rank is not trusted as a label.
        self.rejected = Counter(
            _PREFIX + "rejected_subscriptions",
            "Subscriptions refused by reason (unauthenticated, over_capacity)",
            ("reason",),
            registry=r,
        )
        self.resumes = counter(
            "resumes", "Subscriptions resumed from the recent-batch ring (no snapshot needed)"
        )

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
