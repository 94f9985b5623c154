"""The cache protocol (sim.cache_api) over vLLM 0.33's real KVCacheManager.

Runs only inside .venv-vllm. Used by test_sim_vllm_agreement.py (in a subprocess) to check that
SimCache makes the same decisions as vLLM on the same request sequences. It drives vLLM's
manager exactly like vLLM's scheduler does (reference §9.3), including the scheduler's own
`_mamba_block_aligned_split` and the admission gate (full_sequence_must_fit).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus

from sim.cache_api import CacheRequest, CacheSpec, GroupSpec, Lookup
from sim.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

_HASH = get_hash_fn_by_name("sha256")
kv_cache_utils.init_none_hash(_HASH)


def _vllm_spec(g: GroupSpec) -> Any:
    common: dict[str, Any] = {
        "block_size": g.block_size,
        "num_kv_heads": 1,
        "head_size": 8,
        "dtype": torch.float16,
    }
    if g.kind == "full_attention":
        return FullAttentionSpec(**common)
    if g.kind == "sliding_window":
        return SlidingWindowSpec(**common, sliding_window=g.sliding_window)
    if g.kind == "mamba":
        return MambaSpec(
            block_size=g.block_size,
            shapes=((1, 8),),
            dtypes=(torch.float16,),
            mamba_cache_mode="align",
        )
    raise ValueError(g.kind)


def _event(ev: Any) -> KvEvent:
    name = type(ev).__name__
    if name == "BlockStored":
        return BlockStored(
            block_hashes=list(ev.block_hashes),
            parent_block_hash=ev.parent_block_hash,
            token_ids=list(ev.token_ids),
            block_size=ev.block_size,
            lora_id=ev.lora_id,
            medium=ev.medium,
            lora_name=ev.lora_name,
            extra_keys=None
            if ev.extra_keys is None
            else [None if k is None else tuple(k) for k in ev.extra_keys],
            group_idx=ev.group_idx,
            kv_cache_spec_kind=ev.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=ev.kv_cache_spec_sliding_window,
        )
    if name == "BlockRemoved":
        return BlockRemoved(list(ev.block_hashes), ev.medium, group_idx=ev.group_idx)
    if name == "AllBlocksCleared":
        return AllBlocksCleared()
    raise TypeError(name)


class VllmProtocolBackend:
    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        groups = [KVCacheGroupSpec([f"layer{i}"], _vllm_spec(g)) for i, g in enumerate(spec.groups)]
        config = KVCacheConfig(
            num_blocks=spec.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=groups,
            prefix_cache_retention_interval=spec.retention_interval,
        )
        self.manager = KVCacheManager(
            config,
            max_model_len=spec.max_model_len,
            scheduler_block_size=spec.scheduler_block_size,
            hash_block_size=spec.hash_block_size,
            max_in_flight_tokens=spec.max_in_flight_tokens,
            enable_caching=spec.enable_caching,
            enable_kv_cache_events=True,
        )
        self.hasher = kv_cache_utils.get_request_block_hasher(spec.hash_block_size, _HASH)
        self.requests: dict[str, Request] = {}
        coord = self.manager.coordinator
        mamba = spec.mamba_block_size
        partial = bool(getattr(coord, "enable_partial_hash_hits", False))
        self._split_self = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=mamba),
            block_size=spec.scheduler_block_size,
            hash_block_size=spec.hash_block_size,
            mamba_partial_cache_hit=(
                mamba is not None and spec.hash_block_size < spec.scheduler_block_size and partial
            ),
            use_eagle_block_drop=False,
            num_hash_lookahead_tokens=0,
            mamba_has_prefill_checkpoint_blocks=False,
            mamba_prefill_checkpoint_alignment=None,
            max_num_scheduled_tokens=spec.max_num_scheduled_tokens,
            scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
            mamba_shared_prefix_checkpoint=False,
        )

    def add_request(self, req: CacheRequest) -> None:
        lora = (
            LoRARequest(req.lora_name, req.lora_id or 1, req.lora_path or "/none")
            if req.lora_name
            else None
        )
        self.requests[req.request_id] = Request(
            req.request_id,
            list(req.prompt_token_ids),
            SamplingParams(max_tokens=req.max_tokens),
            None,
            lora_request=lora,
            cache_salt=req.cache_salt,
            block_hasher=self.hasher,
        )

    def lookup(self, request_id: str) -> Lookup:
        r = self.requests[request_id]
        blocks, hit, boundary = self.manager.get_computed_blocks(r)
        r.shared_prefix_boundary = boundary
        return Lookup(hit, boundary, blocks)

    def per_group_hits(self, request_id: str) -> list[int]:
        r = self.requests[request_id]
        coord = self.manager.coordinator
        if len(self.spec.groups) == 1:
            return [self.manager.get_computed_blocks(r)[1]]
        _, hits = coord.find_longest_cache_hit_per_group(r.block_hashes, r.num_tokens - 1)
        return list(hits)

    def split_chunk(self, request_id: str, n: int, local: int) -> int:
        if self.spec.mamba_block_size is None:
            return n
        return int(
            Scheduler._mamba_block_aligned_split(
                self._split_self,  # type: ignore[arg-type]
                self.requests[request_id],
                n,
                local,
                0,
            )
        )

    def allocate(self, request_id: str, n: int, lookup: Lookup | None = None) -> bool:
        r = self.requests[request_id]
        if lookup is None:
            out = self.manager.allocate_slots(r, n)
        else:
            out = self.manager.allocate_slots(
                r,
                n,
                num_new_computed_tokens=lookup.hit_tokens,
                new_computed_blocks=lookup.handle,  # type: ignore[arg-type]
                full_sequence_must_fit=True,
                has_scheduled_reqs=True,
            )
            if out is not None:
                r.num_computed_tokens = lookup.hit_tokens
                r.status = RequestStatus.RUNNING
        return out is not None

    def advance(self, request_id: str, n: int) -> None:
        self.requests[request_id].num_computed_tokens += n

    def append_token(self, request_id: str, token_id: int) -> None:
        self.requests[request_id].append_output_token_ids(token_id)

    def preempt(self, request_id: str) -> None:
        r = self.requests[request_id]
        self.manager.free(r)
        r.num_computed_tokens = 0
        r.status = RequestStatus.PREEMPTED

    def free(self, request_id: str) -> None:
        r = self.requests.pop(request_id, None)
        if r is not None:
            self.manager.free(r)

    def begin_step(self) -> None:
        self.manager.new_step_starts()

    def end_schedule(self) -> None:
        self.manager.take_boundary_state_offloads()
        _, retained = self.manager.take_kv_cache_block_copies()
        if retained:
            self.manager.block_pool.free_blocks(retained)

    def end_step(self) -> list[KvEvent]:
        return [_event(e) for e in self.manager.take_events()]

    def reset(self) -> bool:
        return bool(self.manager.reset_prefix_cache())

    def usage(self) -> float:
        return float(self.manager.usage)
