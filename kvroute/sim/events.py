"""KV-cache event records, with vLLM 0.33's field names, order and defaults.

The records are the bridge's (`kvroute.bridge.vllm_schema`), so the wire encoder that the simulated
engine's publisher uses (`kvroute.bridge.vllm_schema.encode_batch`) takes them as they are: one
definition of vLLM's event shapes in the project. Hashes are ints (vLLM's default int mode:
the low 64 bits of the digest) or raw bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.bridge.vllm_schema import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["MEDIUM_GPU", "AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "KvEvent"]

MEDIUM_GPU = "GPU"

KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    """One engine step's events (vLLM's KVEventBatch)."""

    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None
