"""The bridge's Prometheus metrics (one registry per bridge instance, no globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "BridgeMetrics"]

_RANK = ("dp_rank",)


class BridgeMetrics:
    """Counters and gauges, labelled by the engine's DP rank where it applies."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.batches = Counter(
            "kvroute_bridge_batches", "Engine batches applied (live or replayed)", _RANK, registry=r
        )
        self.events = Counter(
            "kvroute_bridge_events",
            "Converted events by kind (store, remove, clear, invalid, filtered)",
            (*_RANK, "kind"),
            registry=r,
        )
        self.stored_blocks = Counter(
            "kvroute_bridge_stored_blocks", "Block hashes in converted stores", _RANK, registry=r
        )
        self.gaps = Counter(
            "kvroute_bridge_gaps", "Sequence gaps seen on the live stream", _RANK, registry=r
        )
        self.replays = Counter(
            "kvroute_bridge_replays",
            "Replay requests by outcome (recovered, unrecoverable, timeout, unavailable)",
            (*_RANK, "outcome"),
            registry=r,
        )
        self.replayed_batches = Counter(
            "kvroute_bridge_replayed_batches", "Batches received from replay", _RANK, registry=r
        )
        self.resets = Counter(
            "kvroute_bridge_resets",
            "View resets by reason (gap, restart, malformed, reconnect, ...)",
            (*_RANK, "reason"),
            registry=r,
        )
        self.malformed = Counter(
            "kvroute_bridge_malformed_frames",
            "Malformed messages by problem (frames, seq, payload)",
            (*_RANK, "problem"),
            registry=r,
        )
        self.unknown_fields = Counter(
            "kvroute_bridge_unknown_field_batches",
            "Batches with fields this bridge does not know (ignored)",
            _RANK,
            registry=r,
        )
        self.unknown_removes = Counter(
            "kvroute_bridge_unknown_removes",
            "Removals of blocks the bridge did not hold",
            _RANK,
            registry=r,
        )
        self.evicted_blocks = Counter(
            "kvroute_bridge_state_evicted_blocks",
            "Blocks dropped from the snapshot state at its bound",
            _RANK,
            registry=r,
        )
        self.evicted_lineage_blocks = Counter(
            "kvroute_bridge_state_evicted_lineage_blocks",
            "Lineage-only blocks (ancestors of live blocks) dropped at their bound",
            _RANK,
            registry=r,
        )
        self.lineage_blocks = Gauge(
            "kvroute_bridge_state_lineage_blocks",
            "Blocks kept only to place live blocks in snapshots (their ancestors)",
            _RANK,
            registry=r,
        )
        self.state_blocks = Gauge(
            "kvroute_bridge_state_blocks",
            "Live block copies in the snapshot state",
            _RANK,
            registry=r,
        )
        self.last_sequence = Gauge(
            "kvroute_bridge_last_sequence", "Last engine sequence applied", _RANK, registry=r
        )
        self.engine_connected = Gauge(
            "kvroute_bridge_engine_connected",
            "1 while the engine's PUB socket is connected",
            _RANK,
            registry=r,
        )
        self.lag = Histogram(
            "kvroute_bridge_lag_seconds",
            "Time from the engine's batch timestamp to its conversion by the bridge",
            _RANK,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
            registry=r,
        )
        self.subscribers = Gauge(
            "kvroute_bridge_subscribers", "Connected gRPC subscribers", _RANK, registry=r
        )
        self.snapshots = Counter(
            "kvroute_bridge_snapshots_sent",
            "Snapshots sent to subscribers by reason (initial, lagging, reset, ...)",
            (*_RANK, "reason"),
            registry=r,
        )
        self.snapshot_events = Histogram(
            "kvroute_bridge_snapshot_events",
            "Events per snapshot built",
            _RANK,
            buckets=(1, 10, 100, 1_000, 10_000, 100_000, 1_000_000),
            registry=r,
        )
        self.snapshot_bytes = Histogram(
            "kvroute_bridge_snapshot_bytes",
            "Serialized size of each snapshot built",
            _RANK,
            buckets=(1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9),
            registry=r,
        )
        self.lagging_subscribers = Counter(
            "kvroute_bridge_lagging_subscribers",
            "Times a subscriber fell behind its queue bound and was resynchronised",
            _RANK,
            registry=r,
        )
        self.resumes = Counter(
            "kvroute_bridge_resumes",
            "Subscriptions resumed from the recent-batch ring (no snapshot needed)",
            _RANK,
            registry=r,
        )

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
