"""The chunk a lower-tier STORE shows: the one rule the bridge and the router both apply.

vLLM's `OffloadingConnector` offloads `blocks_per_chunk` GPU blocks at a time and, with
self-describing events, publishes each chunk as one STORE of those blocks' hashes and tokens
(docs/reference/vllm-kv-events.md section 10.3). A view keeps the largest chunk it saw: a
partial recurrent tail shows less than a whole chunk.
"""

from __future__ import annotations

from kvroute.proto.events_pb2 import KvGroupEvent


def store_chunk(event: KvGroupEvent) -> int:
    """Tokens per offloaded chunk that a lower-tier event shows (0: it shows none)."""
    if event.operation != KvGroupEvent.STORE or not event.token_ids:
        return 0
    return len(event.block_hashes) * event.block_size
