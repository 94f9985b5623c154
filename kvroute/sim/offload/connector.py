"""The scheduler's side of vLLM's native CPU offloading (`OffloadingConnector` with
`CPUOffloadingManager`, vLLM 0.33), over the simulated cache (reference §10).

What it does, as vLLM's `OffloadingConnectorScheduler` does:

- Stores are write-through, not on eviction: every step, each scheduled request offers the
  chunks its computed tokens now fill (`_build_store_jobs`), from chunk 0 on admission (chunks
  of the GPU hit already in the tier only count as used; missing ones are copied from the GPU)
  or from the end of what it loaded; a finished request offers up to its last token but one.
  A store completes (and is published) a step after it was prepared.
- A lookup (`_lookup_complete_chunks`) starts at the chunk holding the GPU hit (rounded down
  to the GPU block), counts consecutive readable chunks, is capped at the request's tokens,
  and gives nothing below one chunk beyond the GPU hit. The loaded chunks are pinned until the
  load is done; the load takes `tokens x KV bytes per token / bandwidth` seconds.
- Only models whose groups are all full attention: vLLM publishes the offloaded chunks of
  sliding-window and Mamba groups without tokens (§10.3), so a hybrid tier could not be
  rebuilt from events, and the simulator refuses it rather than model something else.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvroute.ratelog import RateLimitedLog
from kvroute.sim.cache.hashing import external
from kvroute.sim.cache.request import CacheSeq
from kvroute.sim.cache_api import FULL_KINDS, CacheSpec
from kvroute.sim.events import KvEvent
from kvroute.sim.offload.tier import ChunkInfo, CpuTier

log = logging.getLogger(__name__)

GIB = 1 << 30
# PCIe 4.0 x16 as measured for host-to-device copies (~26 GB/s), in bit/s: 200k tokens/s at
# 128 KiB per token, the router's default `policy.cpu_tier_tokens_per_s`.
DEFAULT_CPU_LINK_BITS_PER_S = 210e9


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """vLLM's `--kv-offloading-size` (here bytes) and the host-to-GPU copy rate."""

    cpu_bytes: int
    bytes_per_s: float = DEFAULT_CPU_LINK_BITS_PER_S / 8
    chunk_blocks: int = 1  # vLLM's blocks_per_chunk

    def __post_init__(self) -> None:
        if self.cpu_bytes <= 0 or self.bytes_per_s <= 0 or self.chunk_blocks <= 0:
            raise ValueError("CPU offload size, bandwidth and blocks per chunk must be positive")


def check_offloadable(spec: CacheSpec) -> None:
    """ValueError unless the layout is one vLLM's CPU tier serves from events (see module)."""
    kinds = sorted({g.kind for g in spec.groups} - FULL_KINDS)
    if kinds:
        raise ValueError(
            f"--cpu-offload-gib needs full-attention groups only (this profile has {kinds[0]}): "
            "vLLM publishes such groups' CPU chunks without tokens"
        )


class SeqSource(Protocol):
    """A cache that shows a request's tokens and hash chain (`SimCache.seq`)."""

    def seq(self, request_id: str) -> CacheSeq: ...


@dataclass(slots=True)
class _ReqState:
    stored_upto: int = 0  # chunks [0, stored_upto) were offered
    rank: int = 0  # the request's recency rank in the tier (0: none yet)
    used: dict[int, ChunkInfo] = field(default_factory=dict)  # chunks read or offered
    loading: list[int] = field(default_factory=list)  # pinned for a load in flight

    def use(self, chunks: list[ChunkInfo]) -> None:
        for chunk in chunks:
            self.used.setdefault(chunk.key, chunk)


class OffloadConnector:
    """One engine's CPU tier and the per-request bookkeeping around it."""

    def __init__(
        self, config: OffloadConfig, spec: CacheSpec, cache: SeqSource, kv_bytes_per_token: float
    ) -> None:
        check_offloadable(spec)
        self.config = config
        self.cache = cache
        self.block_size = spec.groups[0].block_size
        self.unit = spec.hash_block_size
        self.chunk_tokens = self.block_size * config.chunk_blocks
        self.kv_bytes_per_token = kv_bytes_per_token
        capacity = int(config.cpu_bytes // (kv_bytes_per_token * self.chunk_tokens))
        if capacity <= 0:
            raise ValueError(
                f"--cpu-offload-gib {config.cpu_bytes / GIB:g} holds no chunk of "
                f"{self.chunk_tokens} tokens"
            )
        self.tier = CpuTier(capacity)
        self._group_kind = spec.groups[0].kind
        self._states: dict[str, _ReqState] = {}
        self._ratelog = RateLimitedLog(log, interval_s=10.0)

    # ---- chunks ---------------------------------------------------------------------------
    def _num_chunks(self, seq: CacheSeq, tokens: int) -> int:
        """Whole chunks within the first `tokens` tokens that have a hash."""
        return min(tokens, len(seq.block_hashes) * self.unit) // self.chunk_tokens

    def _key(self, seq: CacheSeq, chunk: int) -> int:
        return external(seq.block_hashes[(chunk + 1) * self.chunk_tokens // self.unit - 1])

    def _info(self, seq: CacheSeq, chunk: int) -> ChunkInfo:
        start = chunk * self.chunk_tokens
        per_block = self.block_size // self.unit
        first = start // self.unit
        blocks = tuple(
            external(seq.block_hashes[first + (b + 1) * per_block - 1])
            for b in range(self.config.chunk_blocks)
        )
        req = seq.req
        return ChunkInfo(
            key=self._key(seq, chunk),
            end=start + self.chunk_tokens,
            block_hashes=blocks,
            parent_block_hash=external(seq.block_hashes[first - 1]) if first else None,
            token_ids=tuple(seq.all_token_ids[start : start + self.chunk_tokens]),
            block_size=self.block_size,
            lora_id=req.lora_id if req.lora_name else None,
            lora_name=req.lora_name or None,
            kind=self._group_kind,
        )

    # ---- lookups and loads ----------------------------------------------------------------
    def _hit(self, seq: CacheSeq, gpu_hit: int, num_tokens: int) -> tuple[int, list[int], int]:
        """(tokens beyond the GPU hit, keys of the chunks to load, index of the first)."""
        computed = gpu_hit - gpu_hit % self.block_size
        start = computed // self.chunk_tokens
        end = self._num_chunks(seq, num_tokens)
        keys = [self._key(seq, c) for c in range(start, end)]
        hits = self.tier.count_hits(keys)
        hit = min(num_tokens, (start + hits) * self.chunk_tokens) - computed
        if hit < self.chunk_tokens:
            return 0, [], start
        return hit, keys[:hits], start

    def peek(self, request_id: str, gpu_hit: int, num_tokens: int) -> int:
        """Tokens beyond the GPU hit a load from the tier would give now (no side effects)."""
        return self._hit(self.cache.seq(request_id), gpu_hit, num_tokens)[0]

    def _rank(self, state: _ReqState) -> int:
        if not state.rank:
            state.rank = self.tier.new_rank()
        return state.rank

    def lookup(self, request_id: str, gpu_hit: int, num_tokens: int) -> int:
        """On admission: the tokens beyond `gpu_hit` to load from the tier (0: none). A hit
        pins its chunks until `load_done`; the request's stores then start after them."""
        seq = self.cache.seq(request_id)
        state = self._states.setdefault(request_id, _ReqState())
        state.stored_upto = 0
        hit, keys, first = self._hit(seq, gpu_hit, num_tokens)
        if hit:
            chunks = [self._info(seq, c) for c in range(first, first + len(keys))]
            self.tier.pin(keys)
            self.tier.access(chunks, self._rank(state))
            state.loading = keys
            state.use(chunks)
            end = gpu_hit - gpu_hit % self.block_size + hit
            state.stored_upto = -(-end // self.chunk_tokens)
        return hit

    def load_bytes(self, tokens: int) -> float:
        """The KV bytes a load of `tokens` tokens copies from the tier to the GPU."""
        return tokens * self.kv_bytes_per_token

    def load_seconds(self, tokens: int) -> float:
        """Modelled time to copy `tokens` tokens' KV from the tier to the GPU."""
        return self.load_bytes(tokens) / self.config.bytes_per_s

    def load_done(self, request_id: str) -> None:
        """The request's load finished: its chunks may be evicted again."""
        state = self._states.get(request_id)
        if state is not None:
            self.tier.unpin(state.loading)
            state.loading = []

    # ---- stores -----------------------------------------------------------------------------
    def offer(self, request_id: str, num_computed: int) -> None:
        """The request's KV now covers `num_computed` tokens: store the chunks that filled."""
        state = self._states.setdefault(request_id, _ReqState())
        seq = self.cache.seq(request_id)
        end = self._num_chunks(seq, num_computed)
        if end <= state.stored_upto:
            return
        chunks = [self._info(seq, c) for c in range(state.stored_upto, end)]
        # vLLM records (and ranks the request by) the chunks it stores or finds ready, not
        # those another request's store still holds pending
        recorded = self.tier.recorded(chunks)
        rank = self._rank(state) if recorded else 0
        state.use(recorded)
        if self.tier.prepare_store(chunks, rank) is None:
            # no room now (loads pin the rest): offered again next step, as vLLM retries
            self._ratelog.warning(
                "store", "CPU tier full of pinned or pending chunks: a store was skipped"
            )
            return
        state.stored_upto = end

    def finish(self, request_id: str, num_computed: int) -> None:
        """The request ended (call before the cache forgets it): store what it computed up to
        `num_computed` and make everything it used recent."""
        if request_id not in self._states and num_computed < self.chunk_tokens:
            return
        self.offer(request_id, num_computed)
        state = self._states.pop(request_id)
        self.tier.unpin(state.loading)
        self.tier.finish(list(state.used.values()))

    def forget(self, request_id: str) -> None:
        """Drop a request's bookkeeping without storing (its cache state is gone)."""
        state = self._states.pop(request_id, None)
        if state is not None:
            self.tier.unpin(state.loading)

    def state(self) -> dict[str, Any]:
        """What `/sim/state` shows of the tier."""
        tier = self.tier
        return {
            "capacity_chunks": tier.capacity,
            "chunk_tokens": self.chunk_tokens,
            "chunks": len(tier),
            "evicted_chunks": tier.evicted,
            "skipped_stores": tier.store_failures,
        }

    def end_step(self) -> list[KvEvent]:
        """The step's CPU events (after its GPU events in the batch)."""
        return self.tier.end_step()

    def flush(self) -> list[KvEvent]:
        """Complete the stores in flight (the engine is idle)."""
        return self.tier.flush()

    def reset(self) -> None:
        """vLLM's `reset_prefix_cache(reset_connector=True)`: the tier empties silently."""
        self.tier.reset()
        for state in self._states.values():
            state.loading = []
            state.stored_upto = 0
