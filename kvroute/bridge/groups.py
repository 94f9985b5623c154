"""KV cache groups as learned from STOREs, and the INVALID events a contradiction calls for.

A rank stream tracks groups on its own, ahead of the snapshot state (which may be applying
older batches while a snapshot is built), so that what subscribers receive never waits for
the state. Both use this one rule: a STORE that names a known group with another kind or
sliding window, or a new group beyond `max_groups`, discards the view (an INVALID event
before it), after which it declares its group afresh.
"""

from __future__ import annotations

from typing import Final

from kvroute.proto.events_pb2 import KvEventBatch, KvGroupEvent

STORE: Final = KvGroupEvent.STORE
REMOVE: Final = KvGroupEvent.REMOVE
CLEAR: Final = KvGroupEvent.CLEAR
INVALID: Final = KvGroupEvent.INVALID


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


def amend(groups: Groups, batch: KvEventBatch) -> KvEventBatch:
    """Track `batch`'s groups in `groups`; returns what subscribers must receive: `batch`
    itself, or a copy with an INVALID event before each contradicting STORE (the same
    batch `EngineState.apply` returns)."""
    positions: set[int] = set()
    for index, event in enumerate(batch.events):
        op = event.operation
        if op == STORE:
            if not groups.declare(event):
                positions.add(index)
                groups.clear()
                groups.declare(event)
        elif op not in (REMOVE, CLEAR):
            groups.clear()  # INVALID, or an operation this version does not know
    return with_invalid_before(batch, positions) if positions else batch


def with_invalid_before(batch: KvEventBatch, positions: set[int]) -> KvEventBatch:
    """A copy of `batch` with an INVALID event of the same group before each position."""
    amended = KvEventBatch(
        sequence=batch.sequence, timestamp=batch.timestamp, dp_rank=batch.dp_rank
    )
    for index, event in enumerate(batch.events):
        if index in positions:
            amended.events.add(operation=INVALID, group_id=event.group_id)
        amended.events.append(event)
    return amended
