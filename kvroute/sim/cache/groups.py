"""Per-group cache rules: one manager per KV cache group kind (reference §5, §6, §7.5).

Each manager owns its requests' block tables and answers three questions the way vLLM's
single-type managers do: how long a prefix it can serve (`find_longest_hit`), how many blocks
an allocation needs, and which full blocks to register in the prefix cache (`cache_blocks`,
with sparse retention masks for sliding window and Mamba). Only the configurations the
simulator offers are modelled: no EAGLE/MTP, no context parallelism, no KV connector, no
speculative or prefill-checkpoint Mamba blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

from kvroute.sim.cache.hashing import Digest, block_digest
from kvroute.sim.cache.pool import Block, BlockPool, Key
from kvroute.sim.cache.request import CacheSeq
from kvroute.sim.cache_api import FULL_KINDS, GroupSpec


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def mamba_checkpoint_position(num_tokens: int, unit: int) -> int:
    """Last unit-aligned position strictly before num_tokens (the last token is recomputed)."""
    return max((num_tokens - 1) // unit * unit, 0)


HitBlocks = list[list[Block]]


class GroupManager:
    """Shared bookkeeping: block tables, cached-block counts, partial-hit copy-on-write."""

    fine_grained: ClassVar[bool] = False  # hits may end inside a block (vLLM's flag)

    def __init__(self, spec: GroupSpec, pool: BlockPool, group_id: int, scheduler_block: int):
        self.spec = spec
        self.pool = pool
        self.group_id = group_id
        self.block_size = spec.block_size
        self.alignment = scheduler_block  # the hybrid coordinator may lower it
        self.admission_cap: int | None = None
        self.req_blocks: dict[str, list[Block]] = {}
        self.num_cached: dict[str, int] = {}
        self.partial_hit_reqs: dict[str, tuple[int, Block]] = {}
        self.pending_cow: list[tuple[Block, Block]] = []

    def blocks(self, rid: str) -> list[Block]:
        """The request's block table (created empty on first use)."""
        return self.req_blocks.setdefault(rid, [])

    @classmethod
    def fine_lookup(cls, block_size: int, alignment: int) -> bool:
        """Whether a lookup at this alignment probes hash-unit boundaries inside blocks."""
        return cls.fine_grained and alignment < block_size and block_size % alignment == 0

    # ---- lookup (class-level: groups with one spec are looked up together) --------
    @classmethod
    def find_longest_hit(
        cls,
        hashes: Sequence[Digest],
        max_length: int,
        group_ids: list[int],
        pool: BlockPool,
        spec: GroupSpec,
        alignment: int,
    ) -> tuple[HitBlocks, int]:
        """(hit blocks per group, hit tokens <= max_length) for groups of this spec, as
        vLLM's manager class finds them."""
        raise NotImplementedError

    # ---- allocation ----------------------------------------------------------------
    def num_skipped_tokens(self, num_computed: int) -> int:
        """Leading tokens whose blocks a request no longer needs (e.g. outside a window)."""
        return 0

    def _partial_local_hit(self, new_computed: Sequence[Block], num_local: int) -> bool:
        return len(new_computed) > 0 and num_local % self.block_size != 0

    def blocks_to_allocate(
        self,
        rid: str,
        num_tokens: int,
        new_computed: Sequence[Block],
        total_computed: int,
        num_local: int,
        num_tokens_main: int,
        apply_cap: bool = False,
    ) -> int:
        """Blocks this allocation would take from the pool, hit blocks that are free now
        included (vLLM's get_num_blocks_to_allocate)."""
        required = cdiv(num_tokens, self.block_size)
        if apply_cap and self.admission_cap is not None:
            required = min(required, self.admission_cap)
        held = len(self.req_blocks.get(rid, ()))
        if rid in self.num_cached:
            return max(required - held, 0)
        skipped_blocks = self.num_skipped_tokens(total_computed) // self.block_size
        new = max(required - max(skipped_blocks, len(new_computed) + held), 0)
        first_kept = max(0, skipped_blocks - held)
        evictable = sum(b.ref_cnt == 0 and not b.is_null for b in new_computed[first_kept:])
        if self._partial_local_hit(new_computed, num_local):
            new += 1  # the copy-on-write block for a hit that ends inside a block
        return new + evictable

    def add_hit_blocks(self, rid: str, new_computed: Sequence[Block], num_local: int) -> None:
        """Adopt a waiting request's hit blocks (skipped ones as null blocks)."""
        table = self.blocks(rid)
        assert not table
        skipped = self.num_skipped_tokens(num_local) // self.block_size
        kept = list(new_computed[skipped:]) if skipped > 0 else list(new_computed)
        if self.pool.enable_caching:
            self.pool.touch(kept)
        table.extend([self.pool.null_block] * skipped)
        table.extend(kept)
        self.num_cached[rid] = len(table)
        if self._partial_local_hit(kept, num_local):
            idx = num_local // self.block_size
            self.partial_hit_reqs[rid] = (idx, kept[-1])
            self.num_cached[rid] = idx

    def _apply_cow(self, rid: str, idx: int, source: Block, cow: Block) -> None:
        table = self.req_blocks[rid]
        assert table[idx] is source
        table[idx] = cow
        self.pending_cow.append((source, cow))
        cow.ref_cnt += 1  # held until the copy "ran" (end of scheduling)

    def allocate_new_blocks(self, rid: str, num_tokens: int, num_tokens_main: int) -> None:
        """Grow the request's table to num_tokens (copying a partially hit block)."""
        if rid in self.partial_hit_reqs:
            idx, source = self.partial_hit_reqs.pop(rid)
            self._apply_cow(rid, idx, source, self.pool.get_new_blocks(1)[0])
        table = self.blocks(rid)
        missing = cdiv(num_tokens, self.block_size) - len(table)
        if missing > 0:
            table.extend(self.pool.get_new_blocks(missing))

    # ---- caching -------------------------------------------------------------------
    def reachable_mask(
        self, start: int, end: int, retention: int | None, boundaries: Sequence[int]
    ) -> list[bool] | None:
        """Which of blocks [start, end) can serve a hit under the retention interval and the
        replay and junction boundaries; None: all of them."""
        return None  # dense: every full block can serve a hit

    def cache_blocks(
        self, seq: CacheSeq, num_tokens: int, retention: int | None, replay: Sequence[int]
    ) -> None:
        """Register the request's newly full (and reachable) blocks in the prefix cache."""
        rid = seq.request_id
        num_cached = self.num_cached.get(rid, 0)
        hashed = len(seq.block_hashes) * self.pool.hash_unit
        num_full = min(num_tokens, hashed) // self.block_size
        if num_cached >= num_full:
            return
        boundaries = list(replay)
        if seq.shared_prefix_boundary:
            boundaries.append(seq.shared_prefix_boundary)
        mask = self.reachable_mask(num_cached, num_full, retention, boundaries)
        self.pool.cache_full_blocks(
            seq, self.blocks(rid), num_cached, num_full, self.block_size, self.group_id, mask
        )
        self.num_cached[rid] = num_full

    # ---- release ---------------------------------------------------------------------
    def _remove_range(self, rid: str, first: int, last: int) -> None:
        """Free blocks [first, last) back to front, stopping at an already-null block."""
        if rid not in self.req_blocks or first >= last:
            return
        table = self.req_blocks[rid]
        last = min(last, len(table))
        freed = []
        for i in range(last - 1, first - 1, -1):
            if table[i].is_null:
                break
            freed.append(table[i])
            table[i] = self.pool.null_block
        if freed:
            self.pool.free_blocks(freed)

    def remove_skipped_blocks(self, rid: str, processed: int) -> None:
        """Free the blocks the request no longer needs after `processed` tokens."""
        skipped = self.num_skipped_tokens(processed)
        if skipped <= 0:
            return
        table = self.blocks(rid)
        self._remove_range(rid, 0, min(skipped // self.block_size, len(table)))

    def pop_blocks(self, rid: str) -> list[Block]:
        """Forget the request; returns its blocks, leading null blocks dropped."""
        table = self.req_blocks.pop(rid, [])
        self.num_cached.pop(rid, None)
        self.partial_hit_reqs.pop(rid, None)
        lead = 0
        while lead < len(table) and table[lead].is_null:
            lead += 1
        return table[lead:]

    def free(self, rid: str) -> None:
        """Forget the request and give its blocks back to the pool."""
        # Tail first, so a request's later blocks are evicted before its earlier ones.
        self.pool.free_blocks(reversed(self.pop_blocks(rid)))

    def take_cow(self) -> list[tuple[Block, Block]]:
        """The (source, copy) pairs queued since the last call."""
        pending, self.pending_cow = self.pending_cow, []
        return pending

    def new_step(self) -> None:
        """A scheduling step starts."""
        return None


class FullAttentionManager(GroupManager):
    """Full (and MLA) attention: dense, contiguous from token 0."""

    fine_grained = True

    @classmethod
    def find_longest_hit(
        cls,
        hashes: Sequence[Digest],
        max_length: int,
        group_ids: list[int],
        pool: BlockPool,
        spec: GroupSpec,
        alignment: int,
    ) -> tuple[HitBlocks, int]:
        bs, unit = spec.block_size, pool.hash_unit
        found: HitBlocks = [[] for _ in group_ids]
        num_blocks = min(max_length // bs, len(hashes) // (bs // unit))
        for i in range(num_blocks):
            cached = pool.get_cached(block_digest(hashes, unit, bs, i), group_ids)
            if not cached:
                break
            for lst, blk in zip(found, cached, strict=True):
                lst.append(blk)
        hit = len(found[0]) * bs
        if cls.fine_lookup(bs, alignment):
            # A partial entry inside the first missing block extends the hit (high to low).
            scale = bs // alignment
            first = len(found[0]) * scale
            top = min(first + scale - 1, max_length // alignment, len(hashes))
            for idx in range(top - 1, first - 1, -1):
                tail = pool.get_cached(hashes[idx], group_ids)
                if tail:
                    for lst, blk in zip(found, tail, strict=True):
                        lst.append(blk)
                    hit = (idx + 1) * alignment
                    break
        hit -= hit % alignment
        keep = cdiv(hit, bs)
        for lst in found:
            del lst[keep:]
        return found, hit

    def cache_blocks(
        self, seq: CacheSeq, num_tokens: int, retention: int | None, replay: Sequence[int]
    ) -> None:
        super().cache_blocks(seq, num_tokens, retention, replay)
        if self.block_size != self.pool.hash_unit:
            self._cache_partial_tail(seq, num_tokens)

    def _cache_partial_tail(self, seq: CacheSeq, num_tokens: int) -> None:
        """Register the prompt's last hash-unit boundary <= prompt_len - 1 inside a block."""
        unit = self.pool.hash_unit
        boundary = min((seq.num_prompt_tokens - 1) // unit, len(seq.block_hashes)) * unit
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        table = self.blocks(seq.request_id)
        idx = boundary // self.block_size
        if idx < len(table):
            self.pool.cache_partial_block(seq, table[idx], boundary, self.group_id)


class SlidingWindowManager(GroupManager):
    """Sliding window W: a hit needs the cdiv(W-1, block) blocks ending at it."""

    def __init__(self, spec: GroupSpec, pool: BlockPool, group_id: int, scheduler_block: int):
        super().__init__(spec, pool, group_id, scheduler_block)
        assert spec.sliding_window is not None
        self.window = spec.sliding_window

    @staticmethod
    def blocks_needed(window: int, block_size: int) -> int:
        return cdiv(window - 1, block_size)

    @classmethod
    def find_longest_hit(
        cls,
        hashes: Sequence[Digest],
        max_length: int,
        group_ids: list[int],
        pool: BlockPool,
        spec: GroupSpec,
        alignment: int,
    ) -> tuple[HitBlocks, int]:
        bs, unit = spec.block_size, pool.hash_unit
        assert spec.sliding_window is not None
        need = cls.blocks_needed(spec.sliding_window, bs)
        max_blocks = max_length // bs
        found: HitBlocks = [[pool.null_block] * max_blocks for _ in group_ids]
        run = 0
        complete = False
        for i in range(max_blocks - 1, -1, -1):
            cached = pool.get_cached(block_digest(hashes, unit, bs, i), group_ids)
            if not cached:
                run = 0
                continue
            if run == 0 and bs != alignment and ((i + 1) * bs) % alignment != 0:
                continue  # a run must end on an aligned boundary
            for lst, blk in zip(found, cached, strict=True):
                lst[i] = blk
            run += 1
            if run >= need:
                for lst in found:
                    del lst[i + run :]
                complete = True
                break
        if not complete:
            # Nothing precedes token 0: a shorter run from block 0 still counts.
            for lst in found:
                del lst[run:]
            while bs != alignment and len(found[0]) * bs % alignment != 0:
                for lst in found:
                    lst.pop()
        return found, len(found[0]) * bs

    def num_skipped_tokens(self, num_computed: int) -> int:
        return max(0, num_computed - self.window + 1)

    def reachable_mask(
        self, start: int, end: int, retention: int | None, boundaries: Sequence[int]
    ) -> list[bool] | None:
        bs, align = self.block_size, self.alignment
        if align % bs != 0:
            return None
        need = self.blocks_needed(self.window, bs)
        mask = [False] * (end - start)
        segment = align if retention is None else (retention or None)
        if segment is not None:
            per_segment = segment // bs
            if need >= per_segment:
                return None
            for i in range(start, end):
                if i % per_segment >= per_segment - need:
                    mask[i - start] = True
        if retention is not None:
            for boundary in boundaries:
                edge = boundary // align * align // bs
                for j in range(max(start, edge - need), min(end, edge)):
                    mask[j - start] = True
        return mask


class MambaManager(GroupManager):
    """Mamba in "align" mode: a hit needs a saved state exactly at its position."""

    fine_grained = True

    def __init__(self, spec: GroupSpec, pool: BlockPool, group_id: int, scheduler_block: int):
        super().__init__(spec, pool, group_id, scheduler_block)
        self.cached_this_step: set[Key] = set()
        self.last_state_idx: dict[str, int] = {}
        self.retired: dict[str, int] = {}
        self.allocated: set[str] = set()

    @classmethod
    def find_longest_hit(
        cls,
        hashes: Sequence[Digest],
        max_length: int,
        group_ids: list[int],
        pool: BlockPool,
        spec: GroupSpec,
        alignment: int,
    ) -> tuple[HitBlocks, int]:
        bs, unit = spec.block_size, pool.hash_unit
        # Where a state may be saved, highest first, with its hash: any hash-unit boundary
        # (full or partial key) when fine-grained, else aligned block ends.
        candidates: Iterable[tuple[int, Digest]]
        if cls.fine_lookup(bs, alignment):
            top = min(max_length // alignment, len(hashes))
            candidates = (((i + 1) * alignment, hashes[i]) for i in range(top - 1, -1, -1))
        else:
            candidates = (
                ((i + 1) * bs, block_digest(hashes, unit, bs, i))
                for i in range(max_length // bs - 1, -1, -1)
                if (i + 1) * bs % alignment == 0
            )
        found: HitBlocks = [[] for _ in group_ids]
        for end, digest in candidates:
            cached = pool.get_cached(digest, group_ids)
            if cached:
                for lst, blk in zip(found, cached, strict=True):
                    lst.extend([pool.null_block] * ((end - 1) // bs))  # blocks before its own
                    lst.append(blk)
                return found, end
        return found, 0

    def num_skipped_tokens(self, num_computed: int) -> int:
        return num_computed - 1  # only the latest state is needed

    def reachable_mask(
        self, start: int, end: int, retention: int | None, boundaries: Sequence[int]
    ) -> list[bool] | None:
        if retention is None:
            return None
        bs, align = self.block_size, self.alignment
        mask = [False] * (end - start)
        if retention:
            per_segment = retention // bs
            if per_segment <= 1:
                return None
            first = (start + per_segment) // per_segment * per_segment - 1
            for i in range(first - start, len(mask), per_segment):
                mask[i] = True
        for boundary in boundaries:
            state_block = boundary // align * align // bs - 1
            if start <= state_block < end:
                mask[state_block - start] = True
        return mask

    def blocks_to_allocate(
        self,
        rid: str,
        num_tokens: int,
        new_computed: Sequence[Block],
        total_computed: int,
        num_local: int,
        num_tokens_main: int,
        apply_cap: bool = False,
    ) -> int:
        if new_computed and new_computed[-1].key in self.cached_this_step:
            # A state cached this step is not written yet: wait for the next step.
            return self.pool.num_blocks + 1
        new = cdiv(num_tokens_main, self.block_size) - len(new_computed) - len(self.blocks(rid))
        partial = self._partial_local_hit(new_computed, num_local) or rid in self.partial_hit_reqs
        if partial:
            new = max(new, 0) + 1
        if new > 0:
            new = min(new, 1 + int(partial))
        evictable = sum(b.ref_cnt == 0 and not b.is_null for b in new_computed)
        return new + evictable  # may be negative, as in vLLM

    def allocate_new_blocks(self, rid: str, num_tokens: int, num_tokens_main: int) -> None:
        table = self.blocks(rid)
        required = cdiv(num_tokens_main, self.block_size)
        partial = self.partial_hit_reqs.get(rid)
        if required <= len(table) and partial is None:
            self.allocated.add(rid)
            return
        prev_len = len(table)
        was_allocated = rid in self.allocated
        if was_allocated or prev_len > 0:
            self.last_state_idx[rid] = prev_len - 1
        if prev_len < required - 1:
            table.extend([self.pool.null_block] * (required - 1 - prev_len))
        missing = max(required - len(table), 0) + (1 if partial is not None else 0)
        new_blocks = self.pool.get_new_blocks(missing)
        if partial is not None:
            idx, source = partial
            cow, new_blocks = new_blocks[0], new_blocks[1:]
            if was_allocated:
                # A running request keeps writing into source: the cache entry moves to a copy.
                assert table[idx] is source
                self.pool.move_keys(source, cow)
                self.pending_cow.append((source, cow))
                source.ref_cnt += 1
                if cow.key is not None:
                    self.cached_this_step.add(cow.key)
            else:
                self._apply_cow(rid, idx, source, cow)
        table.extend(new_blocks)
        self.allocated.add(rid)
        self.partial_hit_reqs.pop(rid, None)

    def remove_skipped_blocks(self, rid: str, processed: int) -> None:
        skipped = self.num_skipped_tokens(processed)
        if skipped > 0:
            table = self.blocks(rid)
            self._retire(rid, min(skipped // self.block_size, len(table)))
        last = self.last_state_idx.get(rid)
        if last is not None and last < cdiv(processed, self.block_size) - 1:
            table = self.blocks(rid)
            if not table[last].is_null:
                self.pool.free_blocks([table[last]])
                table[last] = self.pool.null_block

    def _retire(self, rid: str, last: int) -> None:
        """Free interior states below `last` (null gaps are skipped, not a stop)."""
        table = self.req_blocks.get(rid, [])
        first = self.retired.get(rid, 0)
        last = min(last, len(table))
        if first >= last:
            return
        freed = []
        for i in range(last - 1, first - 1, -1):
            if table[i].is_null:
                continue
            freed.append(table[i])
            table[i] = self.pool.null_block
        if freed:
            self.pool.free_blocks(freed)
        self.retired[rid] = last

    def cache_blocks(
        self, seq: CacheSeq, num_tokens: int, retention: int | None, replay: Sequence[int]
    ) -> None:
        rid = seq.request_id
        before = self.num_cached.get(rid, 0)
        super().cache_blocks(seq, num_tokens, retention, replay)
        after = self.num_cached.get(rid, 0)
        partial_key = self._cache_partial_tail(seq, num_tokens)
        if partial_key is not None:
            self.cached_this_step.add(partial_key)
        table = self.blocks(rid)
        for idx in range(before, after):
            blk = table[idx]
            if not blk.is_null and blk.key is not None:
                self.cached_this_step.add(blk.key)

    def _cache_partial_tail(self, seq: CacheSeq, num_tokens: int) -> Key | None:
        """Checkpoint the prompt's last hash-unit boundary when a chunk ends exactly there."""
        unit = self.pool.hash_unit
        if num_tokens <= 0 or num_tokens % unit:
            return None
        if num_tokens != mamba_checkpoint_position(seq.num_prompt_tokens, unit):
            return None
        idx = cdiv(num_tokens, self.block_size) - 1
        table = self.blocks(seq.request_id)
        if idx >= len(table) or table[idx].is_null or table[idx].key_tokens == num_tokens:
            return None
        source = table[idx]
        key = self.pool.cache_partial_block(seq, source, num_tokens, self.group_id)
        if key is not None and num_tokens % self.block_size:
            self.partial_hit_reqs[seq.request_id] = (idx, source)
            self.num_cached[seq.request_id] = idx
        return key

    def pop_blocks(self, rid: str) -> list[Block]:
        self.allocated.discard(rid)
        self.last_state_idx.pop(rid, None)
        self.retired.pop(rid, None)
        return super().pop_blocks(rid)

    def new_step(self) -> None:
        self.cached_this_step.clear()


def manager_class(spec: GroupSpec) -> type[GroupManager]:
    if spec.kind in FULL_KINDS:
        return FullAttentionManager
    if spec.kind == "sliding_window":
        return SlidingWindowManager
    return MambaManager
