"""KV cache groups as learned from STOREs, and the INVALID events a contradiction calls for.

A rank stream tracks groups on its own, ahead of the snapshot state (which may be applying
older batches while a snapshot is built), so that what subscribers receive never waits for
the state. Both use this one rule: a STORE that names a known group with another kind or
sliding window, or a new group beyond `max_groups`, discards the view (an INVALID event
before it), after which it declares its group afresh. Each lower tier (`tier_events`) has
groups of its own, so a contradiction there discards that tier's view only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from kvroute.proto.events_pb2 import KvEventBatch, KvGroupEvent, Tier

STORE: Final = KvGroupEvent.STORE
REMOVE: Final = KvGroupEvent.REMOVE
CLEAR: Final = KvGroupEvent.CLEAR
INVALID: Final = KvGroupEvent.INVALID
# The tiers a bridge keeps a view of besides the GPU; events of any other tier pass through.
LOWER_TIERS: Final = (Tier.CPU, Tier.STORAGE)


class Group:
    """What a group's STOREs say: attention kind, sliding window, largest block size."""

    __slots__ = ("block_size", "kind", "window")

    def __init__(self, kind: str, window: int, block_size: int) -> None:
        self.kind = kind
        self.window = window
        self.block_size = block_size


class Groups:
    """group id -> `Group`, at most `max_groups` of them."""

    def __init__(self, max_groups: int) -> None:
        self.max_groups = max_groups
        self.table: dict[int, Group] = {}

    def clear(self) -> None:
        """Forget every group (an INVALID event or a reset)."""
        self.table.clear()

    def declare(self, event: KvGroupEvent) -> bool:
        """Learn a STORE's group metadata; False if it contradicts what is known (then
        nothing changes)."""
        group = self.table.get(event.group_id)
        if group is None:
            if len(self.table) >= self.max_groups:
                return False
            self.table[event.group_id] = Group(event.kind, event.sliding_window, event.block_size)
            return True
        if (
            event.kind
            and group.kind
            and (event.kind, event.sliding_window) != (group.kind, group.window)
        ):
            return False
        if event.kind and not group.kind:
            group.kind, group.window = event.kind, event.sliding_window
        if event.block_size > group.block_size:
            group.block_size = event.block_size
        return True


class TierGroups:
    """The GPU's `Groups` and each lower tier's, created on first use (as the state's)."""

    def __init__(self, max_groups: int) -> None:
        self.max_groups = max_groups
        self.gpu = Groups(max_groups)
        self.lower: dict[Tier.ValueType, Groups] = {}

    def clear(self) -> None:
        """Forget every group of every tier (a reset)."""
        self.gpu.clear()
        self.lower.clear()

    def tier(self, tier: Tier.ValueType) -> Groups:
        """A lower tier's groups."""
        groups = self.lower.get(tier)
        if groups is None:
            groups = self.lower[tier] = Groups(self.max_groups)
        return groups


def amend(groups: TierGroups, batch: KvEventBatch) -> KvEventBatch:
    """Track `batch`'s groups, per tier, in `groups`; returns what subscribers must receive:
    `batch` itself, or a copy with an INVALID event before each contradicting STORE in
    `events` or `tier_events` (the same batch `EngineState.apply` returns)."""
    positions = _contradictions(groups.gpu, batch.events)
    tier_positions: set[int] = set()
    if batch.tier_events:
        for tier in LOWER_TIERS:
            at = [i for i, event in enumerate(batch.tier_events) if event.tier == tier]
            if at:
                local = _contradictions(groups.tier(tier), (batch.tier_events[i] for i in at))
                tier_positions.update(at[i] for i in local)
    if not positions and not tier_positions:
        return batch
    return with_invalid_before(batch, positions, tier_positions)


def _contradictions(groups: Groups, events: Iterable[KvGroupEvent]) -> set[int]:
    """Track the groups of `events`, in order; the positions that need an INVALID before."""
    positions: set[int] = set()
    for index, event in enumerate(events):
        op = event.operation
        if op == STORE:
            if not groups.declare(event):
                positions.add(index)
                groups.clear()
                groups.declare(event)
        elif op not in (REMOVE, CLEAR):
            groups.clear()  # INVALID, or an operation this version does not know
    return positions


def with_invalid_before(
    batch: KvEventBatch, positions: set[int], tier_positions: set[int]
) -> KvEventBatch:
    """A copy of `batch` with an INVALID event of the same group (and tier) before each
    position of `events` in `positions` and of `tier_events` in `tier_positions`."""
    amended = KvEventBatch(
        sequence=batch.sequence, timestamp=batch.timestamp, dp_rank=batch.dp_rank
    )
    for index, event in enumerate(batch.events):
        if index in positions:
            amended.events.add(operation=INVALID, group_id=event.group_id)
        amended.events.append(event)
    for index, event in enumerate(batch.tier_events):
        if index in tier_positions:
            amended.tier_events.add(operation=INVALID, group_id=event.group_id, tier=event.tier)
        amended.tier_events.append(event)
    return amended
