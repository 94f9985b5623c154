"""Combining the groups: the joint hit (fixed point, reference §7.4) and per-step plumbing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.sim.cache.groups import (
    GroupManager,
    HitBlocks,
    SlidingWindowManager,
    cdiv,
    manager_class,
)
from kvroute.sim.cache.hashing import Digest
from kvroute.sim.cache.pool import Block, BlockPool
from kvroute.sim.cache.request import CacheSeq
from kvroute.sim.cache_api import FULL_KINDS, CacheSpec, GroupSpec


@dataclass(slots=True)
class LookupUnit:
    """Groups with an identical spec, looked up together (a block must hit in all of them)."""

    spec: GroupSpec
    group_ids: list[int]
    cls: type[GroupManager]

    @property
    def is_full(self) -> bool:
        """Full attention (or MLA): looked up first, once."""
        return self.spec.kind in FULL_KINDS


class Coordinator:
    """All groups of one model over one block pool."""

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self.hybrid = len(spec.groups) > 1
        self.pool = BlockPool(spec.num_blocks, spec.hash_block_size, spec.enable_caching)
        sched = spec.scheduler_block_size
        self.managers: list[GroupManager] = [
            manager_class(g)(g, self.pool, i, sched) for i, g in enumerate(spec.groups)
        ]
        in_flight = spec.max_in_flight_tokens or spec.max_model_len
        for mgr in self.managers:
            if isinstance(mgr, SlidingWindowManager):
                # Recycling-aware per-request admission cap (+1: the window may straddle).
                tokens = min(mgr.window - 1 + in_flight, spec.max_model_len)
                mgr.admission_cap = cdiv(tokens, mgr.block_size) + 1
        self.alignment = spec.alignment if self.hybrid else spec.groups[0].block_size
        if self.hybrid:
            for mgr in self.managers:
                mgr.alignment = self.alignment
        units: list[LookupUnit] = []
        for i, g in enumerate(spec.groups):
            for unit in units:
                if unit.spec == g:
                    unit.group_ids.append(i)
                    break
            else:
                units.append(LookupUnit(g, [i], manager_class(g)))
        units.sort(key=lambda u: not u.is_full)  # full attention first: cheapest bound
        self.units = units

    # ---- lookup ------------------------------------------------------------------------
    def _lookup_unit(
        self, unit: LookupUnit, hashes: Sequence[Digest], max_length: int
    ) -> tuple[HitBlocks, int]:
        return unit.cls.find_longest_hit(
            hashes, max_length, unit.group_ids, self.pool, unit.spec, self.alignment
        )

    def find_longest_hit(
        self, hashes: Sequence[Digest], max_length: int
    ) -> tuple[list[list[Block]], int, int]:
        """(hit blocks per group, joint hit, uncached common prefix)."""
        n = len(self.managers)
        if not self.hybrid:
            blocks, hit = self._lookup_unit(self.units[0], hashes, max_length)
            return blocks, hit, 0
        hit = max_length
        longest = 0
        per_group: list[list[Block] | None] = [None] * n
        per_group_len = [0] * n
        simple = len(self.units) == 2 and self.units[0].is_full
        while True:
            cur = hit
            for unit in self.units:
                first = unit.group_ids[0]
                if unit.is_full and per_group[first] is not None:
                    # Full attention is downward closed: look it up once, then clamp.
                    cur = min(cur, per_group_len[first])
                    continue
                blocks, new_len = self._lookup_unit(unit, hashes, cur)
                cur = new_len
                for gid, lst in zip(unit.group_ids, blocks, strict=True):
                    per_group[gid] = lst
                    per_group_len[gid] = new_len
                longest = max(longest, cur)
            if cur >= hit:
                break
            hit = cur
            if simple:
                break
        for unit in self.units:
            if not unit.is_full:
                continue
            keep = cdiv(hit, unit.spec.block_size)
            for gid in unit.group_ids:
                kept = per_group[gid]
                if kept is not None:
                    del kept[keep:]
        return [blocks or [] for blocks in per_group], hit, longest - hit

    def per_group_hits(self, hashes: Sequence[Digest], max_length: int) -> list[int]:
        """Each group's own longest hit, ignoring the others (for inspection and tests)."""
        hits = [0] * len(self.managers)
        for unit in self.units:
            _, length = self._lookup_unit(unit, hashes, max_length)
            for gid in unit.group_ids:
                hits[gid] = length
        return hits

    # ---- allocation ----------------------------------------------------------------
    def blocks_to_allocate(
        self,
        rid: str,
        num_tokens: int,
        new_computed: Sequence[Sequence[Block]],
        total_computed: int,
        num_local: int,
        num_tokens_main: int,
        apply_cap: bool = False,
    ) -> int:
        """Blocks this allocation would take from the pool, over all groups."""
        return sum(
            mgr.blocks_to_allocate(
                rid,
                num_tokens,
                new_computed[i],
                total_computed,
                num_local,
                num_tokens_main,
                apply_cap,
            )
            for i, mgr in enumerate(self.managers)
        )

    def add_hit_blocks(
        self, rid: str, new_computed: Sequence[Sequence[Block]], num_local: int
    ) -> None:
        """Every group adopts a waiting request's hit blocks."""
        if any(rid in mgr.num_cached for mgr in self.managers):
            return  # a running request gets no new hits
        for i, mgr in enumerate(self.managers):
            mgr.add_hit_blocks(rid, new_computed[i], num_local)

    def allocate_new_blocks(self, rid: str, num_tokens: int, num_tokens_main: int) -> None:
        """Every group grows the request's table to num_tokens."""
        for mgr in self.managers:
            mgr.allocate_new_blocks(rid, num_tokens, num_tokens_main)

    def cacheable_tokens(self, num_computed: int) -> int:
        """How much of the computed prefix may be cached (hybrid models without partial hits
        cache whole scheduler blocks only)."""
        if self.hybrid and not self.spec.partial_hits:
            return num_computed // self.spec.scheduler_block_size * self.spec.scheduler_block_size
        return num_computed

    def cache_blocks(self, seq: CacheSeq, num_computed: int) -> None:
        """Every group registers the request's newly full blocks."""
        if not self.spec.enable_caching:
            return
        replay = (seq.num_prompt_tokens - 1,)
        tokens = self.cacheable_tokens(num_computed)
        for mgr in self.managers:
            mgr.cache_blocks(seq, tokens, self.spec.retention_interval, replay)

    def remove_skipped_blocks(self, rid: str, processed: int) -> None:
        """Every group frees the blocks the request no longer needs."""
        for mgr in self.managers:
            mgr.remove_skipped_blocks(rid, processed)

    def free(self, rid: str) -> None:
        """Every group gives the request's blocks back to the pool."""
        for mgr in self.managers:
            mgr.free(rid)

    def take_cow(self) -> list[tuple[Block, Block]]:
        """Every group's (source, copy) pairs queued since the last call."""
        out: list[tuple[Block, Block]] = []
        for mgr in self.managers:
            out.extend(mgr.take_cow())
        return out

    def new_step(self) -> None:
        """A scheduling step starts."""
        for mgr in self.managers:
            mgr.new_step()
