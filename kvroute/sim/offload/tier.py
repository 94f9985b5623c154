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

Recency is vLLM's `lru` order. Each request gets a rank when it first stores or loads
(`new_rank`, later requests higher); a chunk it stores or reads is ranked (request rank,
minus the chunk's end position), so within a live request the tail goes before the head, and
a chunk keeps the higher of the ranks it was given. When the request finishes, its chunks
get fresh ranks above everything, tail first, so its head is the most recent of all. The
lowest rank is evicted first.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvroute.sim.events import BlockRemoved, BlockStored, KvEvent

MEDIUM_CPU = "CPU"

Rank = tuple[int, int]


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """A chunk: its key, its end position in the prompt (token count up to its end, the same
    for every request that holds it) and what its self-describing events carry (vLLM's
    `_OffloadEventMetadata`)."""

    key: int
    end: int
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
    rank: Rank
    ready: bool = False
    pins: int = 0


class CpuTier:
    """`capacity` chunk slots (see the module docstring). Pure: no clock, no I/O."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"the CPU tier needs at least one chunk, got {capacity}")
        self.capacity = capacity
        self._slots: dict[int, _Slot] = {}
        # (rank, key) of chunks that may be evictable; stale entries are skipped on eviction
        self._heap: list[tuple[Rank, int]] = []
        self._next_rank = 0
        self._prepared: list[int] = []  # stores prepared in the current step
        self._in_flight: list[int] = []  # stores prepared in the previous step
        self._events: list[KvEvent] = []
        self.store_failures = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._slots)

    def new_rank(self) -> int:
        """A rank for a request that starts using the tier (above every earlier one)."""
        self._next_rank += 1
        return self._next_rank

    def is_hit(self, key: int) -> bool:
        """Whether the chunk is held and readable (a pending store is not)."""
        slot = self._slots.get(key)
        return slot is not None and slot.ready

    def ready_chunks(self) -> list[ChunkInfo]:
        """The chunks a load could read now, the next to be evicted first."""
        slots = sorted(self._slots.values(), key=lambda s: s.rank)
        return [slot.info for slot in slots if slot.ready]

    def count_hits(self, keys: Sequence[int]) -> int:
        """Consecutive readable chunks from the start of `keys` (vLLM's maximal prefix)."""
        n = 0
        for key in keys:
            if not self.is_hit(key):
                break
            n += 1
        return n

    def recorded(self, chunks: Iterable[ChunkInfo]) -> list[ChunkInfo]:
        """The chunks an offer records as used: those not held, or held and ready (vLLM does
        not count a chunk whose store is still in flight)."""
        return [c for c in chunks if c.key not in self._slots or self._slots[c.key].ready]

    # ---- recency ----------------------------------------------------------------------------
    def _set_rank(self, key: int, slot: _Slot, rank: Rank) -> None:
        slot.rank = rank
        if slot.ready and not slot.pins:
            heapq.heappush(self._heap, (rank, key))
        if len(self._heap) > 4 * len(self._slots) + 64:  # drop the stale entries
            self._heap = [(s.rank, k) for k, s in self._slots.items() if s.ready and not s.pins]
            heapq.heapify(self._heap)

    def access(self, chunks: Iterable[ChunkInfo], rank: int) -> None:
        """A live request of `rank` read or offered these held, ready chunks."""
        for chunk in chunks:
            slot = self._slots.get(chunk.key)
            if slot is not None and slot.ready and slot.rank < (rank, -chunk.end):
                self._set_rank(chunk.key, slot, (rank, -chunk.end))

    def finish(self, chunks: Sequence[ChunkInfo]) -> None:
        """A request that used these chunks (any order) ended: they become the most recent,
        its head last."""
        for chunk in sorted(chunks, key=lambda c: -c.end):
            slot = self._slots.get(chunk.key)
            if slot is not None:
                self._set_rank(chunk.key, slot, (self.new_rank(), 0))

    # ---- stores -------------------------------------------------------------------------------
    def prepare_store(self, chunks: Sequence[ChunkInfo], rank: int) -> list[int] | None:
        """A request of `rank` offers its chunks; returns the keys newly stored, None if there
        was no room (nothing stored). Held chunks only count as used (`access`)."""
        self.access(chunks, rank)
        new = [c for c in chunks if c.key not in self._slots]
        if not new:
            return []
        need = len(new) - (self.capacity - len(self._slots))
        if need > 0:
            victims = self._victims(need, {c.key for c in chunks})
            if victims is None:
                self.store_failures += 1
                return None
            removed: list[int | bytes] = []
            for key in victims:
                removed.extend(self._slots.pop(key).info.block_hashes)
            self.evicted += len(victims)
            self._events.append(BlockRemoved(block_hashes=removed, medium=MEDIUM_CPU, group_idx=0))
        for chunk in new:
            self._slots[chunk.key] = _Slot(chunk, (rank, -chunk.end))
        self._prepared.extend(c.key for c in new)
        return [c.key for c in new]

    def _victims(self, n: int, protected: set[int]) -> list[int] | None:
        """The n lowest-ranked evictable chunks outside `protected`, taken off the heap (or
        None, and the heap unchanged, if there are not enough)."""
        taken: list[tuple[Rank, int]] = []
        kept: list[tuple[Rank, int]] = []
        seen: set[int] = set()
        while self._heap and len(taken) < n:
            entry = heapq.heappop(self._heap)
            rank, key = entry
            slot = self._slots.get(key)
            if slot is None or slot.rank != rank or not slot.ready or slot.pins or key in seen:
                continue  # stale: the chunk is gone, re-ranked, pinned or already counted
            seen.add(key)
            (kept if key in protected else taken).append(entry)
        for entry in kept:
            heapq.heappush(self._heap, entry)
        if len(taken) < n:
            for entry in taken:
                heapq.heappush(self._heap, entry)
            return None
        return [key for _, key in taken]

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
                if not slot.pins:
                    heapq.heappush(self._heap, (slot.rank, key))

    def end_step(self) -> list[KvEvent]:
        """A step ended: the stores prepared a step ago are complete. Returns the step's CPU
        events in vLLM's order (this step's removals, then the completed stores)."""
        for key in self._in_flight:
            slot = self._slots.get(key)
            if slot is not None and not slot.ready:
                slot.ready = True
                heapq.heappush(self._heap, (slot.rank, key))
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
        self._heap.clear()
        self._prepared.clear()
        self._in_flight.clear()
        self._events.clear()
