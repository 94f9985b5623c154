"""CPU-tier events and answers from vLLM 0.33's own offloading code (spec §10).

Run with the vLLM environment's python, never imported by pytest:
`python tests/conformance/offload_producer.py` writes one msgpack document to stdout.

It drives the scheduler-side pieces of the native `OffloadingConnector` that run without a GPU:
a real `CPUOffloadingManager` (LRU, a few chunks, so stores evict) and a real
`OffloadingEventsTracker`, fed with real `Request`s (vLLM's sha256 block hasher). Stores go
through `prepare_store` / `complete_store` as `_build_store_jobs` and the transfer completion
do, each step's events are translated by the tracker and encoded by vLLM's msgspec encoder as
`ZmqEventPublisher` does. Two engines: one with `self_describing_kv_events`, one with the
default placeholder payload.

After every step the document records, per probe prompt and GPU hit, how many more tokens
the CPU tier would give: the manager's own `lookup` answer per chunk, combined as
`_lookup_complete_chunks` does for a full-attention-only model (search from the chunk holding
the GPU hit, consecutive hits, capped at the prompt, nothing below one chunk). That last step
is the one part written here rather than called: the scheduler class needs a whole engine.
"""

from __future__ import annotations

import random
import sys
import time
from typing import Any

import msgspec
from vllm.distributed.kv_events import KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventGroupSpec,
    OffloadingEventsTracker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import GroupOffloadConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingKVEventsConfig,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.request import Request

BLOCK = 16
BLOCKS_PER_CHUNK = 2
CHUNK = BLOCK * BLOCKS_PER_CHUNK
CPU_CHUNKS = 9
STEPS = 14
GPU_HITS = (0, 16, 32, 48, 64)


def _group() -> GroupOffloadConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=None)  # type: ignore[arg-type]
    return GroupOffloadConfig(
        group_idx=0,
        tokens_per_block=BLOCK,
        tokens_per_chunk=CHUNK,
        hashes_per_chunk=CHUNK // BLOCK,
        kv_event_group_spec=OffloadingEventGroupSpec("full_attention", None),
        sliding_window_size_in_chunks=None,
        kv_cache_spec=spec,
        manager_cls=FullAttentionManager,
    )


class Engine:
    """One engine's CPU tier: manager, tracker and vLLM's encoder."""

    def __init__(self, self_describing: bool) -> None:
        self.manager = CPUOffloadingManager(num_chunks=CPU_CHUNKS, enable_events=True)
        self.tracker = OffloadingEventsTracker(
            OffloadingKVEventsConfig(
                enable_kv_cache_events=True, self_describing_kv_events=self_describing
            ),
            {0: OffloadingEventGroupSpec("full_attention", None)},
        )
        self.encoder = msgspec.msgpack.Encoder()
        self.group = _group()

    def offload(self, request: Request) -> None:
        """Offer every complete chunk of the request, as `_build_store_jobs` does."""
        ctx = ReqContext(req_id=request.request_id)
        keys = [
            make_offload_key(request.block_hashes[(i + 1) * BLOCKS_PER_CHUNK - 1], 0)
            for i in range(len(request.block_hashes) // BLOCKS_PER_CHUNK)
        ]
        out = self.manager.prepare_store(keys, ctx)
        if out is None:
            return
        for key in out.keys_to_store:
            self.tracker.record_store(request, self.group, keys.index(key), key)
        self.manager.complete_store(out.keys_to_store, ctx)
        self.manager.on_request_finished(ctx)

    def step_payload(self) -> bytes:
        events = list(self.tracker.take_events(list(self.manager.take_events())))
        result: bytes = self.encoder.encode(KVEventBatch(ts=time.time(), events=events))
        return result

    def cpu_hit(self, request: Request, gpu_hit: int) -> int:
        """Tokens beyond `gpu_hit` a load from this CPU tier would give (see the docstring)."""
        ctx = ReqContext(req_id="probe")
        n = request.num_tokens
        chunks = len(request.block_hashes) // BLOCKS_PER_CHUNK
        start = gpu_hit // CHUNK
        hits = 0
        for i in range(start, chunks):
            key = make_offload_key(request.block_hashes[(i + 1) * BLOCKS_PER_CHUNK - 1], 0)
            if self.manager.lookup(key, ctx) is not LookupResult.HIT:
                break
            hits += 1
        end = min(CHUNK * (start + hits), n)
        return end - gpu_hit if end - gpu_hit >= CHUNK else 0

    def resident(self, requests: list[Request]) -> list[Any]:
        """The per-block hashes (as published) of every chunk the CPU tier holds."""
        ctx = ReqContext(req_id="probe")
        held: list[Any] = []
        for request in requests:
            for i in range(len(request.block_hashes) // BLOCKS_PER_CHUNK):
                key = make_offload_key(request.block_hashes[(i + 1) * BLOCKS_PER_CHUNK - 1], 0)
                if self.manager.lookup(key, ctx) is LookupResult.HIT:
                    chunk = request.block_hashes[i * BLOCKS_PER_CHUNK : (i + 1) * BLOCKS_PER_CHUNK]
                    held.extend(maybe_convert_block_hash(h) for h in chunk)
        return held


def main() -> None:
    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    hasher = kv_cache_utils.get_request_block_hasher(BLOCK, hash_fn)
    rng = random.Random(32)
    prefixes = [[rng.randrange(1000, 30000) for _ in range(48)] for _ in range(3)]

    def request(rid: str, tokens: list[int]) -> Request:
        return Request(rid, tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)

    engines = {"self_describing": Engine(True), "placeholder": Engine(False)}
    prompts: list[list[int]] = []
    steps: list[dict[str, Any]] = []
    for step in range(STEPS):
        prefix = prefixes[step % len(prefixes)]
        tail = [rng.randrange(1000, 30000) for _ in range(rng.choice((16, 40, 64, 80)))]
        prompts.append(prefix + tail)
        reqs = [request(f"s{step}", prompts[-1])]
        record: dict[str, Any] = {}
        for name, engine in engines.items():
            engine.offload(reqs[0])
            probes_reqs = [request(f"p{i}", p) for i, p in enumerate(prompts)]
            record[name] = {
                "payload": engine.step_payload(),
                "resident": engine.resident(probes_reqs),
                "probes": [
                    [i, g, engine.cpu_hit(r, g)]
                    for i, r in enumerate(probes_reqs)
                    for g in GPU_HITS
                    if g < r.num_tokens
                ],
            }
        steps.append(record)
    doc = {"block_size": BLOCK, "chunk": CHUNK, "prompts": prompts, "steps": steps}
    sys.stdout.buffer.write(msgspec.msgpack.encode(doc))


if __name__ == "__main__":
    main()
