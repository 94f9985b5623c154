"""Records the index returns: per-worker scores with their per-group breakdown, and stats."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class GroupScore:
    """One KV cache group's own longest hit for a request (vLLM's per-group lookup)."""

    group_id: int
    kind: str
    block_size: int
    sliding_window: int
    accepted_tokens: int | None  # None when the kind cannot be modelled


@dataclass(frozen=True, slots=True)
class WorkerScore:
    """A worker's predicted reuse and why. `reusable_tokens` is None when there is no
    usable evidence (different from 0); it includes `expected_tokens`, the credit from a
    live speculative expectation, where that is larger than the event-based answer."""

    reusable_tokens: int | None
    groups: list[GroupScore]
    alignment: int  # 0 when the layout is unusable
    reason: str  # empty when the event-based answer is usable
    expected_tokens: int = 0


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """Counters and sizes of one worker's view."""

    last_sequence: int | None
    valid: bool  # the view gives a score (groups known, all modelled)
    blocks_per_group: dict[int, int] = field(default_factory=dict)
    entries: int = 0  # blocks with a known position
    pending: int = 0  # blocks waiting for a position
    evicted: int = 0  # entries dropped at the cap
    resets: int = 0  # views discarded: gaps, INVALID, conflicts, invalidate()
    pending_evicted: int = 0  # pending reports dropped at their cap
    stale: int = 0  # batches ignored as old or repeated
    gaps: int = 0  # sequence gaps (each discarded the view)
    conflicts: int = 0  # contradicting evidence (each discarded the view)
    invalid: int = 0  # INVALID events (each discarded the view)
    malformed: int = 0  # events the indexer could not interpret (each discarded the view)
    snapshots: int = 0  # snapshots applied
    expectations: int = 0  # live speculative expectations (FleetIndex)
    reason: str = ""  # why `valid` is False
