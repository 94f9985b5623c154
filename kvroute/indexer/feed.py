"""Sequence order for one worker's stream of batches and snapshots."""

from __future__ import annotations

from kvroute.indexer.lineage import Lineage
from kvroute.indexer.results import WorkerStats
from kvroute.proto import events_pb2

_LINEAGE_COUNTERS = ("evicted", "pending_evicted", "resets", "conflicts", "invalid", "malformed")


class Feed:
    """Applies batches in sequence order: an old or repeated sequence is ignored, a gap
    discards the view and then applies the batch (a new observation); a snapshot
    replaces the view; `invalidate` forgets it until new evidence arrives."""

    def __init__(self, lineage: Lineage) -> None:
        self.lineage = lineage
        self.last_sequence: int | None = None
        self.stale = 0
        self.gaps = 0
        self.snapshots = 0

    def apply(self, batch: events_pb2.KvEventBatch) -> bool:
        """Apply one batch; False when it was ignored as stale."""
        seq = batch.sequence
        last = self.last_sequence
        if last is not None:
            if seq <= last:
                self.stale += 1
                return False
            if seq != last + 1:
                self.gaps += 1
                self.lineage.discard()
        self.lineage.apply_batch(batch.events)
        self.last_sequence = seq
        return True

    def apply_snapshot(self, snapshot: events_pb2.Snapshot) -> None:
        """Replace the view with the snapshot's contents and take its sequence."""
        self.snapshots += 1
        self.lineage.discard(counted=False)
        self.lineage.apply_batch(snapshot.events, lineage=snapshot.lineage)
        self.last_sequence = snapshot.sequence if snapshot.has_sequence else None

    def adopt_snapshot(self, lineage: Lineage, snapshot: events_pb2.Snapshot) -> Lineage:
        """Replace the view with `lineage`, which holds `snapshot` applied to an empty view
        (built on the side); its counters continue the old view's. Returns the old one."""
        old = self.lineage
        for counter in _LINEAGE_COUNTERS:
            setattr(lineage, counter, getattr(lineage, counter) + getattr(old, counter))
        self.lineage = lineage
        self.snapshots += 1
        self.last_sequence = snapshot.sequence if snapshot.has_sequence else None
        return old

    def invalidate(self) -> None:
        """Forget the view and the sequence (the stream was lost)."""
        self.lineage.discard()
        self.last_sequence = None

    def stats(self) -> WorkerStats:
        """The view's counters and sizes."""
        lin = self.lineage
        layout = lin.layout()
        return WorkerStats(
            last_sequence=self.last_sequence,
            valid=layout.usable,
            blocks_per_group=lin.blocks_per_group(),
            entries=lin.entries,
            pending=lin.pending,
            evicted=lin.evicted,
            resets=lin.resets,
            pending_evicted=lin.pending_evicted,
            stale=self.stale,
            gaps=self.gaps,
            conflicts=lin.conflicts,
            invalid=lin.invalid,
            malformed=lin.malformed,
            snapshots=self.snapshots,
            reason=layout.reason,
        )
