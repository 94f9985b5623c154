"""KV-cache event records, with vLLM 0.33's field names, order and defaults.

These are what a cache backend returns from `end_step()` and what the publisher hands to the
wire encoder (`bridge.vllm_schema`). Fields that vLLM declares without a default come first;
the rest default to None (omitted from >=0.24 maps, written as nil in <=0.23 arrays).
Hashes are ints (vLLM's default int mode: the low 64 bits of the digest) or raw bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BlockHashValue = int | bytes

MEDIUM_GPU = "GPU"


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[BlockHashValue]
    parent_block_hash: BlockHashValue | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[BlockHashValue]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    """One engine step's events (vLLM's KVEventBatch)."""

    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None
