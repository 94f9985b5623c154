"""Lower KV tiers (CPU, storage) per worker, and what a load from them restores (spec §10).

Each worker gets one `GroupCache` per lower tier, fed with the batches' `tier_events` of that
tier (a CLEAR among the GPU `events` clears them too), each bounded by its own entry and
pending caps. `TierIndex.split` answers, for a request and the worker's GPU hit, how many more
prompt tokens the CPU tier and then the storage tier give, with the rule of vLLM's native
`OffloadingConnector` (`_lookup_complete_chunks`):

- the search starts at the chunk holding the GPU hit (rounded down to the GPU block size);
  a chunk counts when every full-attention group holds it in a lower tier, consecutive
  chunks from there, up to the prompt's length;
- fewer tokens than one chunk beyond the GPU hit give nothing. The chunk is learned from the
  tier's live stores (one store = one chunk, `kvroute.proto.tier_chunk`). A snapshot's runs
  keep no chunk boundaries (the bridge joins a chain of chunks into one run), so a snapshot
  says the chunk the bridge learned per tier (`tier_chunks`). From a bridge that predates
  that field, a view assumes the greatest common divisor of the runs, a multiple of the chunk,
  until a live store shows the chunk (a chunk learned before the snapshot stays if it divides
  that): often lower, and wrong where a run starts past a chunk the tier evicted;
- a worker with a sliding-window or Mamba group gets nothing from lower tiers: vLLM would
  need that group's window or state from the tier too, and publishes those chunks without
  tokens, so no event can confirm them (the answer is lower than vLLM's, never higher);
- a chunk held by the CPU tier is counted as CPU, else as storage;
- a chunk is known only once its parent chain is placed within that tier's own view: a chunk
  stored after its tier evicted its parent waits as pending (again lower, never higher).
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from math import gcd

from kvroute.indexer.group_cache import GroupCache
from kvroute.indexer.layout import Layout, Rule
from kvroute.proto import events_pb2
from kvroute.proto.tier_chunk import store_chunk

CPU = events_pb2.Tier.CPU
STORAGE = events_pb2.Tier.STORAGE
LOWER_TIERS = (CPU, STORAGE)  # nearest first
_CLEAR = events_pb2.KvGroupEvent.CLEAR


@dataclass(frozen=True, slots=True)
class TierTokens:
    """A request's prompt tokens a worker can restore, by tier: `gpu` from the GPU pool,
    then `cpu` and `storage` more by a load (0 when the tier has nothing to give)."""

    gpu: int
    cpu: int = 0
    storage: int = 0

    @property
    def cached(self) -> int:
        """Every token the engine will not prefill (what vLLM reports as cached)."""
        return self.gpu + self.cpu + self.storage


class _TierView:
    __slots__ = ("cache", "live_chunk", "snapshot_chunk")

    def __init__(self, cache: GroupCache) -> None:
        self.cache = cache
        self.live_chunk = 0  # tokens per offloaded chunk: the largest live store seen
        self.snapshot_chunk = 0  # the last snapshot's runs' common divisor (a multiple)

    @property
    def chunk(self) -> int:
        return self.live_chunk or self.snapshot_chunk


class TierIndex:
    """Every worker's lower tiers. Pure: no I/O, no clock, no threads."""

    def __init__(
        self,
        hash_unit: int = 16,
        *,
        max_entries_per_tier: int = 2_000_000,
        max_pending_per_tier: int = 100_000,
    ) -> None:
        if hash_unit <= 0:
            raise ValueError("hash_unit must be positive")
        self.hash_unit = hash_unit
        self._max_entries = max_entries_per_tier
        self._max_pending = max_pending_per_tier
        self._views: dict[str, dict[int, _TierView]] = {}

    def _view(self, worker_id: str, tier: int) -> _TierView:
        views = self._views.setdefault(worker_id, {})
        view = views.get(tier)
        if view is None:
            cache = GroupCache(
                self.hash_unit, max_entries=self._max_entries, max_pending=self._max_pending
            )
            view = views[tier] = _TierView(cache)
        return view

    def apply(self, worker_id: str, batch: events_pb2.KvEventBatch) -> None:
        """Apply one of the worker's batches (every batch, so each tier sees every sequence)."""
        cleared = any(event.operation == _CLEAR for event in batch.events)
        for tier in LOWER_TIERS:
            events = [event for event in batch.tier_events if event.tier == tier]
            if not events and tier not in self._views.get(worker_id, {}):
                continue
            view = self._view(worker_id, tier)
            part = events_pb2.KvEventBatch(sequence=batch.sequence, timestamp=batch.timestamp)
            if cleared:
                part.events.add(operation=_CLEAR)
            part.events.extend(events)
            self._learn_chunk(view, events)
            view.cache.apply(part)

    def apply_snapshot(self, worker_id: str, snapshot: events_pb2.Snapshot) -> None:
        """Replace the worker's lower tiers with a snapshot's (a tier absent there is empty)."""
        chunks = {c.tier: c.tokens for c in snapshot.tier_chunks}
        for tier in LOWER_TIERS:
            events = [event for event in snapshot.tier_events if event.tier == tier]
            lineage = [event for event in snapshot.tier_lineage if event.tier == tier]
            chunk = chunks.get(tier, 0)
            known = tier in self._views.get(worker_id, {})
            if not events and not lineage and not chunk and not known:
                continue
            view = self._view(worker_id, tier)
            part = events_pb2.Snapshot(
                sequence=snapshot.sequence,
                has_sequence=snapshot.has_sequence,
                dp_rank=snapshot.dp_rank,
                events=events,
                lineage=lineage,
            )
            runs = 0
            for event in events:
                runs = gcd(runs, store_chunk(event))
            view.snapshot_chunk = runs
            if chunk:  # what the bridge learned from the tier's live stores
                view.live_chunk = chunk
            elif not runs or (view.live_chunk and runs % view.live_chunk):
                view.live_chunk = 0
            view.cache.apply_snapshot(part)

    @staticmethod
    def _learn_chunk(view: _TierView, events: Sequence[events_pb2.KvGroupEvent]) -> None:
        for event in events:
            view.live_chunk = max(view.live_chunk, store_chunk(event))

    def invalidate(self, worker_id: str) -> None:
        """The worker's stream was lost: its lower tiers give nothing until new evidence."""
        for view in self._views.get(worker_id, {}).values():
            view.cache.invalidate()

    def remove_worker(self, worker_id: str) -> None:
        """Forget the worker."""
        self._views.pop(worker_id, None)

    def knows(self, worker_id: str) -> bool:
        """Whether any lower-tier event of the worker was ever applied (and not forgotten)."""
        return worker_id in self._views

    def workers(self) -> list[str]:
        """The workers with a lower-tier view, in the order they were first seen."""
        return list(self._views)

    def blocks(self, worker_id: str) -> dict[int, int]:
        """Tier -> blocks with a known position held there (bounded per tier)."""
        return {
            tier: view.cache.stats().entries
            for tier, view in self._views.get(worker_id, {}).items()
        }

    def split(
        self, worker_id: str, layout: Layout, keys: Sequence[int], n_tokens: int, gpu_hit: int
    ) -> TierTokens:
        """The request's tokens per tier on this worker: `gpu_hit` (the GPU answer), then what
        the CPU and storage tiers add under the rule of the module docstring. `layout` is
        the worker's GPU layout (the groups every load must fill)."""
        views = self._views.get(worker_id)
        if not views or not layout.usable:
            return TierTokens(gpu_hit)
        if any(unit.rule is not Rule.FULL for unit in layout.units):
            return TierTokens(gpu_hit)
        chunk = max(view.chunk for view in views.values())
        if chunk <= 0 or chunk % self.hash_unit:
            return TierTokens(gpu_hit)
        group_ids = [g.group_id for g in layout.groups]
        block = min(g.block_size for g in layout.groups)
        presence = {tier: view.cache.presence_by_group() for tier, view in views.items()}
        start = gpu_hit - gpu_hit % block
        position = start - start % chunk
        end = min(n_tokens, len(keys) * self.hash_unit)
        counted: dict[int, int] = {CPU: 0, STORAGE: 0}
        while position + chunk <= end:
            tier = _holder(presence, group_ids, keys[(position + chunk) // self.hash_unit - 1])
            if tier is None:
                break
            # Only the part beyond the GPU hit is loaded from the tier.
            counted[tier] += position + chunk - max(position, gpu_hit)
            position += chunk
        if sum(counted.values()) < chunk:
            return TierTokens(gpu_hit)
        return TierTokens(gpu_hit, counted[CPU], counted[STORAGE])


def _holder(
    presence: dict[int, dict[int, Container[int]]], group_ids: list[int], key: int
) -> int | None:
    """The nearest tier that holds the chunk ending at `key` in every group, else storage when
    the groups hold it between them, else None."""
    spread = {group: False for group in group_ids}
    for tier in LOWER_TIERS:
        groups = presence.get(tier)
        if groups is None:
            continue
        held = [group for group in group_ids if key in groups.get(group, ())]
        if len(held) == len(group_ids):
            return tier
        for group in held:
            spread[group] = True
    return STORAGE if all(spread.values()) else None
