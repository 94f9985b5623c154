"""The CPU tier itself: a fixed number of chunk slots with LRU eviction, as vLLM 0.33's
`CPUOffloadingManager` with its `lru` policy keeps them (reference §10.2).

A chunk is keyed by the request's hash at the chunk's last hash unit. Its life:

- `prepare_store` (while the engine schedules the step that computes the chunk) takes a slot,
  evicting the least recently used ready, unpinned chunks if the tier is full (published
  at once as `BlockRemoved`); the chunk is then *pending* (not yet a hit);
- `end_step` completes the stores prepared in the previous step (the copy takes a step): the
  chunk becomes a hit and its `BlockStored` is published;
- a load pins the chunks it reads (`pin`/`unpin`); pinned chunks are never evicted.

If the chunks a store needs cannot all be freed, the store is skipped as a whole, as vLLM's
`prepare_store` returns None ("cannot store chunks") and nothing is published.

Recency follows vLLM's order where it matters for eviction (its `lru` policy ranks a live
request's chunks together, tail before head): a request's newly stored chunks enter most
recent, the head last; the connector touches the chunks a request loaded or stored whenever
it stores more, and all of them when it finishes, the head last.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvroute.sim.events import BlockRemoved, BlockStored, KvEvent

MEDIUM_CPU = "CPU"


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """What a chunk's self-describing events carry (vLLM's `_OffloadEventMetadata`)."""

    key: int
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    group_idx: int = 0
    kind: str = "full_attention"

    def stored(self) -> BlockStored:
        """The chunk's `BlockStored` with medium CPU (one per chunk, extra keys not carried)."""
        return BlockStored(
            block_hashes=list(self.block_hashes),
            parent_block_hash=self.parent_block_hash,
            token_ids=list(self.token_ids),
            block_size=self.block_size,
            lora_id=self.lora_id,
            medium=MEDIUM_CPU,
            lora_name=self.lora_name,
            extra_keys=None,
            group_idx=self.group_idx,
            kv_cache_spec_kind=self.kind,
        )


@dataclass(slots=True)
class _Slot:
    info: ChunkInfo
    ready: bool = False
    pins: int = 0


class CpuTier:
    """`capacity` chunk slots (see the module docstring). Pure: no clock, no I/O."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"the CPU tier needs at least one chunk, got {capacity}")
        self.capacity = capacity
        # insertion order is recency: the first entry is evicted first
        self._slots: OrderedDict[int, _Slot] = OrderedDict()
        self._prepared: list[int] = []  # stores prepared in the current step
        self._in_flight: list[int] = []  # stores prepared in the previous step
        self._events: list[KvEvent] = []
        self.store_failures = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._slots)

    def is_hit(self, key: int) -> bool:
        """Whether the chunk is held and readable (a pending store is not)."""
        slot = self._slots.get(key)
        return slot is not None and slot.ready

    def ready_chunks(self) -> list[ChunkInfo]:
        """The chunks a load could read now, least recently used first."""
        return [slot.info for slot in self._slots.values() if slot.ready]

    def count_hits(self, keys: Sequence[int]) -> int:
        """Consecutive readable chunks from the start of `keys` (vLLM's maximal prefix)."""
        n = 0
        for key in keys:
            if not self.is_hit(key):
                break
            n += 1
        return n

    def prepare_store(self, chunks: Sequence[ChunkInfo]) -> list[int] | None:
        """Offer a request's chunks (in prompt order); returns the keys newly stored, None if
        there was no room (nothing stored). Chunks already held only count as used; new ones
        take slots, evicting if needed."""
        new = [c for c in chunks if c.key not in self._slots]
        if not new:
            return []
        protected = {c.key for c in chunks}
        need = len(new) - (self.capacity - len(self._slots))
        if need > 0:
            victims = self._victims(need, protected)
            if victims is None:
                self.store_failures += 1
                return None
            removed: list[int] = []
            for key in victims:
                removed.extend(self._slots.pop(key).info.block_hashes)
            self.evicted += len(victims)
            self._events.append(BlockRemoved(block_hashes=removed, medium=MEDIUM_CPU, group_idx=0))
        for chunk in reversed(new):  # the head ends most recent
            self._slots[chunk.key] = _Slot(chunk)
        self._prepared.extend(c.key for c in new)
        return [c.key for c in new]

    def _victims(self, n: int, protected: set[int]) -> list[int] | None:
        victims: list[int] = []
        for key, slot in self._slots.items():
            if len(victims) == n:
                break
            if slot.ready and slot.pins == 0 and key not in protected:
                victims.append(key)
        return victims if len(victims) == n else None

    def touch(self, keys: Iterable[int]) -> None:
        """A request used these chunks (prompt order): the head becomes most recent."""
        for key in reversed(list(keys)):
            if key in self._slots:
                self._slots.move_to_end(key)

    def pin(self, keys: Iterable[int]) -> None:
        """A load reads these (ready) chunks: they cannot be evicted until `unpin`."""
        for key in keys:
            self._slots[key].pins += 1

    def unpin(self, keys: Iterable[int]) -> None:
        """The load that pinned these chunks is done (chunks gone meanwhile are skipped)."""
        for key in keys:
            slot = self._slots.get(key)
            if slot is not None and slot.pins > 0:
                slot.pins -= 1

    def end_step(self) -> list[KvEvent]:
        """A step ended: the stores prepared a step ago are complete. Returns the step's CPU
        events in vLLM's order (this step's removals, then the completed stores)."""
        for key in self._in_flight:
            slot = self._slots.get(key)
            if slot is not None and not slot.ready:
                slot.ready = True
                self._events.append(slot.info.stored())
        self._in_flight, self._prepared = self._prepared, []
        events, self._events = self._events, []
        return events

    def flush(self) -> list[KvEvent]:
        """Complete every store in flight (the engine went idle); their events."""
        events = self.end_step()
        return events + self.end_step()

    def reset(self) -> None:
        """vLLM's `reset_cache`: everything goes, with no event (the GPU's
        `AllBlocksCleared` tells consumers)."""
        self._slots.clear()
        self._prepared.clear()
        self._in_flight.clear()
        self._events.clear()
