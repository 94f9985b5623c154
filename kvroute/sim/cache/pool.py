"""The block pool: fixed physical blocks, refcounts, an LRU free queue, the prefix-hash map.

Semantics follow vLLM's BlockPool (reference §5): block 0 is a permanent null block; freed
blocks with a hash go to the back of the free queue (evicted last, LRU) and blocks without one
to the front; allocating a free cached block evicts it (one BlockRemoved per key it held);
the same (hash, group) may map to several physical blocks (duplicate stores); a block may also
hold partial-entry keys besides its primary key. Events are queued until `take_events`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvroute.sim.cache.hashing import Digest, block_digest, event_extra_keys, external
from kvroute.sim.cache.request import CacheSeq
from kvroute.sim.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

Key = tuple[Digest, int]  # (block hash digest, group id)


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    key: Key | None = None
    key_tokens: int | None = None  # prefix length the primary key stands for
    is_null: bool = False


class FreeQueue:
    """Doubly linked free list over block ids: O(1) pop front, push front/back, remove."""

    _HEAD = -1
    _TAIL = -2

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._next: dict[int, int] = {}
        self._prev: dict[int, int] = {}
        self._blocks = {b.block_id: b for b in blocks}
        self._link(self._HEAD, self._TAIL)
        self.size = 0
        self.append_n(list(blocks))

    def _link(self, a: int, b: int) -> None:
        self._next[a] = b
        self._prev[b] = a

    def popleft_n(self, n: int) -> list[Block]:
        if n > self.size:
            raise ValueError(f"cannot take {n} blocks, {self.size} free")
        out = []
        for _ in range(n):
            first = self._next[self._HEAD]
            self._link(self._HEAD, self._next.pop(first))
            del self._prev[first]
            out.append(self._blocks[first])
        self.size -= n
        return out

    def remove(self, block: Block) -> None:
        bid = block.block_id
        self._link(self._prev.pop(bid), self._next.pop(bid))
        self.size -= 1

    def prepend_n(self, blocks: Sequence[Block]) -> None:
        """Put blocks at the front, keeping their order (the first is taken first)."""
        after = self._next[self._HEAD]
        prev = self._HEAD
        for b in blocks:
            self._link(prev, b.block_id)
            prev = b.block_id
        self._link(prev, after)
        self.size += len(blocks)

    def append_n(self, blocks: Sequence[Block]) -> None:
        for b in blocks:
            last = self._prev[self._TAIL]
            self._link(last, b.block_id)
            self._link(b.block_id, self._TAIL)
        self.size += len(blocks)

    def order(self) -> list[int]:
        """Block ids from first-to-be-taken to last (for tests and debugging)."""
        out, cur = [], self._next[self._HEAD]
        while cur != self._TAIL:
            out.append(cur)
            cur = self._next[cur]
        return out


class BlockPool:
    """Physical blocks shared by all KV cache groups."""

    def __init__(self, num_blocks: int, hash_unit: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.hash_unit = hash_unit
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeQueue(self.blocks)
        self._cached: dict[Key, dict[int, Block]] = {}
        self._extra_keys: dict[int, dict[Key, None]] = {}  # block id -> partial-entry keys
        self.null_block = self.free_queue.popleft_n(1)[0]
        self.null_block.is_null = True
        self._events: list[KvEvent] = []

    # ---- lookup -------------------------------------------------------------------
    def get_cached(self, digest: Digest, group_ids: Sequence[int]) -> list[Block] | None:
        """One cached block per group for this hash (the oldest copy), or None on a miss."""
        found = []
        for gid in group_ids:
            copies = self._cached.get((digest, gid))
            if not copies:
                return None
            found.append(next(iter(copies.values())))
        return found

    def num_free(self) -> int:
        return self.free_queue.size

    def usage(self) -> float:
        total = self.num_blocks - 1
        return 0.0 if total <= 0 else 1.0 - self.num_free() / total

    # ---- key bookkeeping ---------------------------------------------------------
    def _holds(self, key: Key, block: Block) -> bool:
        return block.block_id in self._cached.get(key, {})

    def _insert_key(self, key: Key, block: Block, num_tokens: int | None) -> None:
        if block.key == key or self._holds(key, block):
            return
        if block.key is None:
            block.key, block.key_tokens = key, num_tokens
        else:
            self._extra_keys.setdefault(block.block_id, {})[key] = None
        self._cached.setdefault(key, {})[block.block_id] = block

    def _drop_keys(self, block: Block) -> list[Key]:
        """Unregister every key the block holds; returns the keys actually removed."""
        keys = [] if block.key is None else [block.key]
        keys.extend(self._extra_keys.pop(block.block_id, {}))
        removed = []
        for key in keys:
            copies = self._cached.get(key)
            if copies is not None and copies.pop(block.block_id, None) is not None:
                removed.append(key)
                if not copies:
                    del self._cached[key]
        block.key = block.key_tokens = None
        return removed

    def _emit_removed(self, keys: Iterable[Key]) -> None:
        for digest, gid in keys:
            self._events.append(BlockRemoved([external(digest)], MEDIUM_GPU, group_idx=gid))

    def evict(self, block: Block) -> bool:
        """Drop a block's keys from the prefix cache (it stays allocated if referenced)."""
        removed = self._drop_keys(block)
        self._emit_removed(removed)
        return bool(removed)

    def move_keys(self, src: Block, dst: Block) -> None:
        """Re-point src's cache entries at dst (a private copy); no events."""
        num_tokens = src.key_tokens
        for key in self._drop_keys(src):
            self._insert_key(key, dst, num_tokens)

    # ---- caching -----------------------------------------------------------------
    def cache_full_blocks(
        self,
        seq: CacheSeq,
        blocks: Sequence[Block],
        num_cached: int,
        num_full: int,
        block_size: int,
        group_id: int,
        mask: Sequence[bool] | None,
    ) -> None:
        """Register blocks [num_cached, num_full) of a request and queue one BlockStored."""
        if num_cached >= num_full:
            return
        unit, hashes = self.hash_unit, seq.block_hashes
        stored: list[int] = []
        extras: list[tuple[object, ...] | None] = []
        for i in range(num_cached, num_full):
            blk = blocks[i]
            if blk.is_null or (mask is not None and not mask[i - num_cached]):
                continue
            digest = block_digest(hashes, unit, block_size, i)
            num_tokens = (i + 1) * block_size
            if blk.key is not None:
                # Promotion of a block that held a partial entry: withdraw the old keys.
                self._emit_removed(self._drop_keys(blk))
            self._insert_key((digest, group_id), blk, num_tokens)
            stored.append(external(digest))
            extras.append(event_extra_keys(seq.extra_keys(i * block_size)))
        parent = (
            None
            if num_cached == 0
            else external(block_digest(hashes, unit, block_size, num_cached - 1))
        )
        self._events.append(
            self._stored_event(
                seq,
                stored,
                parent,
                num_cached * block_size,
                num_full * block_size,
                block_size,
                group_id,
                extras,
            )
        )

    def cache_partial_block(
        self,
        seq: CacheSeq,
        block: Block,
        num_tokens: int,
        group_id: int,
        replace_existing: bool = False,
    ) -> Key | None:
        """Make `block` reachable at the hash-unit boundary `num_tokens` (a partial entry)."""
        if block.is_null:
            return None
        unit = self.hash_unit
        n_units = num_tokens // unit
        key = (seq.block_hashes[n_units - 1], group_id)
        already = block.key == key or self._holds(key, block)
        if replace_existing:
            self._emit_removed(self._drop_keys(block))
            already = False
        elif not already and block.key is not None and (block.key_tokens or 0) < n_units * unit:
            self._emit_removed(self._drop_keys(block))
        self._insert_key(key, block, n_units * unit)
        if not already:
            parent = external(seq.block_hashes[n_units - 2]) if n_units > 1 else None
            start = (n_units - 1) * unit
            self._events.append(
                self._stored_event(
                    seq,
                    [external(key[0])],
                    parent,
                    start,
                    num_tokens,
                    num_tokens - start,
                    group_id,
                    [event_extra_keys(seq.extra_keys(start))],
                )
            )
        return key

    @staticmethod
    def _stored_event(
        seq: CacheSeq,
        hashes: list[int],
        parent: int | None,
        start: int,
        end: int,
        block_size: int,
        group_id: int,
        extras: list[tuple[object, ...] | None],
    ) -> BlockStored:
        req = seq.req
        return BlockStored(
            block_hashes=list(hashes),
            parent_block_hash=parent,
            token_ids=seq.all_token_ids[start:end],
            block_size=block_size,
            lora_id=req.lora_id if req.lora_name else None,
            medium=MEDIUM_GPU,
            lora_name=req.lora_name or None,
            extra_keys=list(extras) if extras else None,
            group_idx=group_id,
        )

    # ---- allocation --------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[Block]:
        """Take n blocks from the front of the free queue, evicting their cache entries."""
        taken = self.free_queue.popleft_n(n)
        for blk in taken:
            if self.enable_caching:
                self.evict(blk)
            blk.ref_cnt += 1
        return taken

    def touch(self, blocks: Iterable[Block]) -> None:
        """A cache hit takes a reference (and pulls a free block out of the queue)."""
        for blk in blocks:
            if blk.is_null:
                continue
            if blk.ref_cnt == 0:
                self.free_queue.remove(blk)
            blk.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[Block]) -> None:
        """Drop one reference each; blocks reaching 0 become free (cached ones LRU-last)."""
        first: list[Block] = []
        last: list[Block] = []
        for blk in ordered:
            if blk.is_null:
                continue
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                (first if blk.key is None or not self.enable_caching else last).append(blk)
        self.free_queue.prepend_n(first)
        self.free_queue.append_n(last)

    def reset(self) -> bool:
        """Clear the prefix cache if no block is in use; queues AllBlocksCleared."""
        if self.num_blocks - self.num_free() != 1:
            return False
        self._cached.clear()
        self._extra_keys.clear()
        for blk in self.blocks:
            blk.key = blk.key_tokens = None
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    def cached_keys(self) -> dict[Key, int]:
        """Every cached (hash, group) key and how many physical copies hold it."""
        return {key: len(copies) for key, copies in self._cached.items()}
