"""SimCache: kvroute's reimplementation of vLLM's KVCacheManager behind the cache protocol."""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.sim.cache.coordinator import Coordinator
from kvroute.sim.cache.groups import mamba_checkpoint_position
from kvroute.sim.cache.pool import Block
from kvroute.sim.cache.request import CacheSeq
from kvroute.sim.cache_api import CacheRequest, CacheSpec, Lookup
from kvroute.sim.events import BlockStored, KvEvent


class SimCache:
    """One engine's KV cache (implements `kvroute.sim.cache_api.CacheBackend`)."""

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self.coord = Coordinator(spec)
        self.seqs: dict[str, CacheSeq] = {}
        self._mamba_block = spec.mamba_block_size
        self._mamba_partial = (
            self._mamba_block is not None
            and spec.hash_block_size < spec.scheduler_block_size
            and spec.partial_hits
        )
        self._metadata = [
            (g.kind, g.sliding_window if g.kind == "sliding_window" else None) for g in spec.groups
        ]

    # ---- requests --------------------------------------------------------------------
    def add_request(self, req: CacheRequest) -> None:
        if req.request_id in self.seqs:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.seqs[req.request_id] = CacheSeq(req, self.spec.hash_block_size)

    def seq(self, request_id: str) -> CacheSeq:
        """The request's tokens and hash chain (what a KV connector reads)."""
        return self.seqs[request_id]

    def num_computed_tokens(self, request_id: str) -> int:
        return self.seqs[request_id].num_computed_tokens

    def lookup(self, request_id: str) -> Lookup:
        seq = self.seqs[request_id]
        if not self.spec.enable_caching:
            seq.shared_prefix_boundary = 0
            return Lookup(0)
        blocks, hit, uncached = self.coord.find_longest_hit(seq.block_hashes, seq.num_tokens - 1)
        boundary = hit + uncached if uncached else 0
        seq.shared_prefix_boundary = boundary
        return Lookup(hit, boundary, blocks if any(blocks) else None)

    def per_group_hits(self, request_id: str) -> list[int]:
        seq = self.seqs[request_id]
        return self.coord.per_group_hits(seq.block_hashes, seq.num_tokens - 1)

    def block_ids(self, request_id: str) -> list[list[int]]:
        managers = self.coord.managers
        return [[b.block_id for b in mgr.req_blocks.get(request_id, ())] for mgr in managers]

    def split_chunk(
        self, request_id: str, num_new_tokens: int, num_new_local_computed_tokens: int
    ) -> int:
        """Clip a prefill chunk to end where a Mamba state must be saved (vLLM's
        `_mamba_block_aligned_split`); identity without a Mamba group."""
        bs = self._mamba_block
        if bs is None:
            return num_new_tokens
        seq = self.seqs[request_id]
        start = seq.num_computed_tokens + num_new_local_computed_tokens
        prefill_end = max(seq.num_prompt_tokens, seq.num_tokens - 1)
        if start >= prefill_end:
            return num_new_tokens
        last_cache_position = mamba_checkpoint_position(seq.num_tokens, bs)
        end = start + num_new_tokens
        if end < prefill_end:
            aligned_end = end // bs * bs
            if aligned_end > start or bs <= self.spec.max_num_scheduled_tokens:
                end = aligned_end
        unit = self.spec.hash_block_size
        tail = mamba_checkpoint_position(seq.num_prompt_tokens, unit) if self._mamba_partial else 0
        junction = seq.shared_prefix_boundary
        junction_stop = start + (junction - start) // bs * bs
        stops = (
            (start // bs + 1) * bs if start % bs else 0,
            last_cache_position,
            tail if last_cache_position < tail < seq.num_prompt_tokens else 0,
            junction_stop if start < junction < end else 0,
        )
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)

    def allocate(self, request_id: str, num_new_tokens: int, lookup: Lookup | None = None) -> bool:
        """vLLM's allocate_slots; `lookup` given = admission of a waiting request (its hit
        is adopted and the whole prompt must fit, vLLM's scheduler_reserve_full_isl)."""
        seq = self.seqs[request_id]
        coord = self.coord
        n_groups = len(self.spec.groups)
        handle = lookup.handle if lookup is not None else None
        hit_blocks: Sequence[Sequence[Block]] = (
            handle if isinstance(handle, list) else [[] for _ in range(n_groups)]
        )
        num_new_computed = lookup.hit_tokens if lookup is not None else 0
        num_local = seq.num_computed_tokens + num_new_computed
        total = min(num_local, self.spec.max_model_len)
        free = coord.pool.num_free
        if lookup is not None:
            full = min(seq.num_tokens, self.spec.max_model_len)
            need = coord.blocks_to_allocate(
                request_id, full, hit_blocks, total, num_local, full, apply_cap=True
            )
            if need > free():
                return False
        main = total + num_new_tokens
        slots = min(main, self.spec.max_model_len)
        coord.remove_skipped_blocks(request_id, total)
        need = coord.blocks_to_allocate(request_id, slots, hit_blocks, total, num_local, main)
        if need > free():
            return False
        if handle is not None:
            coord.add_hit_blocks(request_id, hit_blocks, num_local)
        coord.allocate_new_blocks(request_id, slots, main)
        coord.cache_blocks(seq, min(total + num_new_tokens, seq.num_tokens))
        if lookup is not None:
            seq.num_computed_tokens = num_local
        return True

    def advance(self, request_id: str, num_tokens: int) -> None:
        self.seqs[request_id].num_computed_tokens += num_tokens

    def append_token(self, request_id: str, token_id: int) -> None:
        self.seqs[request_id].append_token(token_id)

    def preempt(self, request_id: str) -> None:
        """Give back the request's blocks; it will be recomputed from scratch (keeps tokens)."""
        self.coord.free(request_id)
        self.seqs[request_id].num_computed_tokens = 0

    def free(self, request_id: str) -> None:
        """The request finished or was aborted: blocks return to the pool (stay cached)."""
        self.coord.free(request_id)
        self.seqs.pop(request_id, None)

    # ---- steps -------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.coord.new_step()

    def end_schedule(self) -> None:
        """Copies queued this step have run: release the blocks they pinned."""
        retained = [blk for pair in self.coord.take_cow() for blk in pair]
        if retained:
            self.coord.pool.free_blocks(retained)

    def end_step(self) -> list[KvEvent]:
        events = self.coord.pool.take_events()
        for ev in events:
            if isinstance(ev, BlockStored) and ev.group_idx is not None:
                ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window = self._metadata[
                    ev.group_idx
                ]
        return events

    def reset(self) -> bool:
        return self.coord.pool.reset()

    def usage(self) -> float:
        return self.coord.pool.usage()
