"""`IndexView` over the indexer's `FleetIndex` and `TierIndex`: namespaces, the clock for
expectations, and statistics in the router's records. The indexer itself stays pure (no
clock); this adapter owns time: expectations get an absolute expiry and are expired lazily on
scoring. Every batch and snapshot feeds both indexes: the GPU events the fleet index, the
lower tiers' events (`tier_events`) the tier index, each tier bounded per worker by the same
entry and pending caps as a worker's GPU view."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from kvroute.indexer import FleetIndex, Namespace, TierIndex, content_keys
from kvroute.proto import events_pb2
from kvroute.proto.namespace import salt_namespace
from kvroute.router.routing.index_view import (
    IndexStats,
    ReuseExplanation,
    TierReuse,
)

_EXPIRE_EVERY_S = 0.1
_DEFAULT_NS = Namespace()


def _ns(lora_name: str, cache_salt: str) -> Namespace:
    """The index namespace of a request: events carry the salt's digest, never the salt."""
    if not lora_name and not cache_salt:
        return _DEFAULT_NS
    return Namespace(lora_name=lora_name, cache_salt=salt_namespace(cache_salt))


class FleetIndexView:
    def __init__(
        self,
        hash_unit: int = 16,
        *,
        max_entries_per_worker: int = 2_000_000,
        max_pending_per_worker: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = FleetIndex(
            hash_unit,
            max_entries_per_worker=max_entries_per_worker,
            max_pending_per_worker=max_pending_per_worker,
        )
        self.tier_index = TierIndex(
            hash_unit,
            max_entries_per_tier=max_entries_per_worker,
            max_pending_per_tier=max_pending_per_worker,
        )
        # bumped by every call that changes a worker's view: a snapshot applied in steps
        # reaches the tiers only if nothing changed the worker meanwhile
        self._epochs: dict[str, int] = {}
        self._clock = clock
        self._last_expire = float("-inf")

    def _bump(self, worker: str) -> int:
        epoch = self._epochs.get(worker, 0) + 1
        self._epochs[worker] = epoch
        return epoch

    def _expire(self) -> None:
        now = self._clock()
        if now - self._last_expire >= _EXPIRE_EVERY_S:
            self._last_expire = now
            self.index.expire(now)

    def prompt_keys(
        self, token_ids: Sequence[int], lora_name: str = "", cache_salt: str = ""
    ) -> Sequence[int]:
        return content_keys(token_ids, _ns(lora_name, cache_salt), self.index.hash_unit)

    def score(
        self,
        token_ids: Sequence[int],
        lora_name: str = "",
        cache_salt: str = "",
        keys: Sequence[int] | None = None,
    ) -> Mapping[str, int | None]:
        self._expire()
        if keys is None:
            keys = self.prompt_keys(token_ids, lora_name, cache_salt)
        return self.index.score_keys(keys, len(token_ids))

    def explain(
        self,
        token_ids: Sequence[int],
        lora_name: str = "",
        cache_salt: str = "",
        keys: Sequence[int] | None = None,
    ) -> Mapping[str, ReuseExplanation]:
        self._expire()
        if keys is None:
            keys = self.prompt_keys(token_ids, lora_name, cache_salt)
        out: dict[str, ReuseExplanation] = {}
        for worker, ws in self.index.explain_keys(keys, len(token_ids)).items():
            out[worker] = ReuseExplanation.of(ws)
        return out

    def reach(
        self,
        token_ids: Sequence[int],
        lora_name: str = "",
        cache_salt: str = "",
        keys: Sequence[int] | None = None,
    ) -> tuple[Mapping[str, int | None], Mapping[str, int]]:
        self._expire()
        if keys is None:
            keys = self.prompt_keys(token_ids, lora_name, cache_salt)
        return self.index.reach_keys(keys, len(token_ids))

    def expect(
        self,
        worker: str,
        token_ids: Sequence[int],
        lora_name: str,
        cache_salt: str,
        ttl_s: float,
        keys: Sequence[int] | None = None,
        junction: int = 0,
    ) -> None:
        if keys is None:
            keys = self.prompt_keys(token_ids, lora_name, cache_salt)
        self.index.expect_keys(worker, keys, len(token_ids), self._clock() + ttl_s, junction)

    def tiers(
        self,
        token_ids: Sequence[int],
        gpu: Mapping[str, int | None],
        lora_name: str = "",
        cache_salt: str = "",
        keys: Sequence[int] | None = None,
    ) -> Mapping[str, TierReuse]:
        tiers = self.tier_index
        workers = tiers.workers()
        if not workers:
            return {}
        if keys is None:
            keys = self.prompt_keys(token_ids, lora_name, cache_salt)
        n_tokens = len(token_ids)
        out: dict[str, TierReuse] = {}
        known = set(self.index.workers())
        for worker in workers:
            hit = gpu.get(worker)
            if hit is None or worker not in known:
                continue  # no GPU evidence: nothing to start a lower-tier lookup from
            split = tiers.split(worker, self.index.layout(worker), keys, n_tokens, hit)
            if split.cpu or split.storage:
                out[worker] = TierReuse(split.cpu, split.storage)
        return out

    def apply(self, worker: str, batch: events_pb2.KvEventBatch) -> None:
        self._bump(worker)
        self.index.apply(worker, batch)
        if batch.tier_events or self.tier_index.knows(worker):
            self.tier_index.apply(worker, batch)

    def apply_snapshot(self, worker: str, snapshot: events_pb2.Snapshot) -> None:
        self._bump(worker)
        self.index.apply_snapshot(worker, snapshot)
        self.tier_index.apply_snapshot(worker, snapshot)

    def apply_snapshot_steps(
        self, worker: str, snapshot: events_pb2.Snapshot, blocks_per_step: int
    ) -> Iterator[None]:
        epoch = self._bump(worker)
        yield from self.index.apply_snapshot_steps(worker, snapshot, blocks_per_step)
        # the lower tiers at the end, at once (each is bounded); not if a later call won
        if self._epochs.get(worker) == epoch:
            self.tier_index.apply_snapshot(worker, snapshot)

    def invalidate(self, worker: str) -> None:
        self._bump(worker)
        self.index.invalidate(worker)
        self.tier_index.invalidate(worker)

    def remove_worker(self, worker: str) -> None:
        self._epochs.pop(worker, None)
        self.index.remove_worker(worker)
        self.tier_index.remove_worker(worker)

    def tier_blocks(self, worker: str) -> dict[int, int]:
        """Tier -> blocks with a known position the worker holds there (lower tiers only)."""
        return self.tier_index.blocks(worker)

    def set_alignment(self, worker: str, alignment: int | None) -> None:
        self.index.set_alignment(worker, alignment)

    def stats(self, worker: str) -> IndexStats | None:
        if worker not in self.index.workers():
            return None
        s = self.index.stats(worker)
        return IndexStats(
            s.valid,
            s.last_sequence,
            dict(s.blocks_per_group),
            s.entries,
            s.pending,
            s.evicted,
            s.resets,
        )
