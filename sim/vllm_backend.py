"""Drive vLLM's real KV cache manager the way vLLM's scheduler does.

`VllmCacheBackend` wraps a real `vllm.v1.core.kv_cache_manager.KVCacheManager` (no model, no
GPU) and runs requests through it step by step: prefix lookup, chunked prefill (with the
scheduler's own Mamba block-aligned split), decode, preemption when the pool is full, freeing,
and the end-of-step drains. Every step's KV events come out as vLLM's own `KVEventBatch`.

It is importable only inside the vLLM environment (.venv-vllm). The conformance driver
(tests/conformance/vllm_driver.py) and the simulated engine's vLLM backend both use it.
See reference/vllm-kv-events.md §9 for the recipe this follows.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from vllm.distributed.kv_events import KVEventBatch
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus

GROUP_KINDS = ("full_attention", "sliding_window", "mamba", "circular_buffer")


@dataclass(frozen=True)
class GroupConfig:
    """One KV cache group: its kind, block size and (for sliding window) window."""

    kind: str
    block_size: int
    sliding_window: int | None = None

    def spec(self) -> KVCacheSpec:
        common: dict[str, Any] = {
            "block_size": self.block_size,
            "num_kv_heads": 1,
            "head_size": 8,
            "dtype": torch.float16,
        }
        if self.kind == "full_attention":
            return FullAttentionSpec(**common)
        if self.kind == "sliding_window":
            assert self.sliding_window is not None, "sliding_window groups need a window"
            return SlidingWindowSpec(**common, sliding_window=self.sliding_window)
        if self.kind == "mamba":
            return MambaSpec(
                block_size=self.block_size,
                shapes=((1, 8),),
                dtypes=(torch.float16,),
                mamba_cache_mode="align",
            )
        if self.kind == "circular_buffer":
            # Not prefix-cacheable: it emits no events but still enters the LCM.
            return CircularBufferSpec(**common)
        raise ValueError(f"unknown group kind {self.kind!r}; expected one of {GROUP_KINDS}")

    @property
    def prefix_cacheable(self) -> bool:
        return self.kind != "circular_buffer"


@dataclass(frozen=True)
class BackendConfig:
    """A worker's cache layout and scheduling limits."""

    groups: tuple[GroupConfig, ...]
    num_blocks: int = 64
    # vLLM's prefix_cache_retention_interval: 0 is the engine default (sparse), None is dense.
    retention: int | None = 0
    hash_algo: str = "sha256"
    prefix_match_unit: int | None = None
    max_model_len: int = 8192
    # Token budget of one engine step (max_num_batched_tokens).
    max_num_scheduled_tokens: int = 128

    @property
    def scheduler_block_size(self) -> int:
        return math.lcm(*(g.block_size for g in self.groups))

    @property
    def hash_block_size(self) -> int:
        if len(self.groups) == 1:
            return self.groups[0].block_size
        if self.prefix_match_unit is not None:
            return self.prefix_match_unit
        return math.gcd(*(g.block_size for g in self.groups if g.prefix_cacheable))

    def to_dict(self) -> dict[str, Any]:
        return {
            "groups": [
                {"kind": g.kind, "block_size": g.block_size, "sliding_window": g.sliding_window}
                for g in self.groups
            ],
            "num_blocks": self.num_blocks,
            "retention": self.retention,
            "hash_algo": self.hash_algo,
            "prefix_match_unit": self.prefix_match_unit,
            "max_model_len": self.max_model_len,
            "max_num_scheduled_tokens": self.max_num_scheduled_tokens,
            "scheduler_block_size": self.scheduler_block_size,
            "hash_block_size": self.hash_block_size,
        }


@dataclass(frozen=True)
class Namespace:
    """What a prompt's blocks are cached under besides its tokens."""

    lora_name: str = ""
    cache_salt: str = ""
    # vLLM hashes the adapter's path too but never publishes it; empty means a default path.
    lora_path: str = ""


@dataclass(frozen=True)
class Lookup:
    """vLLM's native answer for a prompt: the joint hit and each group's own hit."""

    hit: int
    per_group: tuple[int, ...]
    shared_prefix_boundary: int


@dataclass
class _Running:
    request: Request
    outputs: list[int]
    on_finish: Callable[[Request], None] | None = None


@dataclass
class StepStats:
    steps: int = 0
    batches: int = 0
    preemptions: int = 0
    deferred_admissions: int = 0
    resets: int = 0
    failed_resets: int = 0
    finished: int = 0
    events: dict[str, int] = field(default_factory=dict)


_HASH_INITIALISED: set[str] = set()


class VllmCacheBackend:
    """A real vLLM KVCacheManager driven like vLLM's scheduler (one engine, one DP rank)."""

    def __init__(
        self,
        config: BackendConfig,
        *,
        clock: Callable[[], float] = time.time,
        publish: Callable[[KVEventBatch], None] | None = None,
    ) -> None:
        self.config = config
        self._clock = clock
        self._publish = publish
        self._batches: list[KVEventBatch] = []
        hash_fn = get_hash_fn_by_name(config.hash_algo)
        # The seed hash is process-wide in vLLM; set it once per algorithm.
        if config.hash_algo not in _HASH_INITIALISED:
            kv_cache_utils.init_none_hash(hash_fn)
            _HASH_INITIALISED.clear()
            _HASH_INITIALISED.add(config.hash_algo)
        self._hasher = kv_cache_utils.get_request_block_hasher(config.hash_block_size, hash_fn)
        kv_config = KVCacheConfig(
            num_blocks=config.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec([f"layer{i}"], g.spec()) for i, g in enumerate(config.groups)
            ],
            prefix_cache_retention_interval=config.retention,
        )
        self.manager = KVCacheManager(
            kv_config,
            max_model_len=config.max_model_len,
            scheduler_block_size=config.scheduler_block_size,
            hash_block_size=config.hash_block_size,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        coordinator = self.manager.coordinator
        self.partial_hash_hits = bool(coordinator.enable_partial_hash_hits)
        # The hit granularity vLLM uses (reference §7.3).
        self.alignment = (
            config.hash_block_size if self.partial_hash_hits else config.scheduler_block_size
        )
        mamba = [g for g in config.groups if g.kind == "mamba"]
        # Stand-in for the scheduler: `_mamba_block_aligned_split` reads only these.
        self._split_self = (
            SimpleNamespace(
                cache_config=SimpleNamespace(block_size=mamba[0].block_size),
                block_size=config.scheduler_block_size,
                hash_block_size=config.hash_block_size,
                mamba_partial_cache_hit=(
                    config.hash_block_size < config.scheduler_block_size and self.partial_hash_hits
                ),
                use_eagle_block_drop=False,
                num_hash_lookahead_tokens=0,
                mamba_has_prefill_checkpoint_blocks=False,
                mamba_prefill_checkpoint_alignment=None,
                max_num_scheduled_tokens=config.max_num_scheduled_tokens,
                scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
                mamba_shared_prefix_checkpoint=False,
            )
            if mamba
            else None
        )
        self._running: list[_Running] = []
        self._waiting: deque[_Running] = deque()
        self._next_id = 0
        self._lora_ids: dict[str, int] = {}
        self.stats = StepStats()

    # ---- requests ---------------------------------------------------------------------------

    def make_request(
        self,
        tokens: Sequence[int],
        namespace: Namespace | None = None,
        *,
        max_tokens: int = 1,
        report_mode: str | None = None,
        prompt_logprobs: int | None = None,
        request_id: str | None = None,
    ) -> Request:
        """A fresh vLLM Request (hashes computed) for these tokens under this namespace."""
        ns = namespace or Namespace()
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        extra_args = {"kv_cache_report_mode": report_mode} if report_mode else None
        lora = None
        if ns.lora_name:
            lora_id = self._lora_ids.setdefault(ns.lora_name, len(self._lora_ids) + 1)
            lora = LoRARequest(ns.lora_name, lora_id, ns.lora_path or f"/adapters/{ns.lora_name}")
        params = SamplingParams(
            max_tokens=max_tokens, extra_args=extra_args, prompt_logprobs=prompt_logprobs
        )
        return Request(
            request_id,
            list(tokens),
            params,
            None,
            lora_request=lora,
            cache_salt=ns.cache_salt or None,
            block_hasher=self._hasher,
        )

    def lookup(
        self,
        tokens: Sequence[int],
        namespace: Namespace | None = None,
        *,
        prompt_logprobs: int | None = None,
    ) -> Lookup:
        """vLLM's own hit for a prompt, without allocating anything (reference §9.3)."""
        request = self.make_request(
            tokens, namespace, prompt_logprobs=prompt_logprobs, request_id="probe"
        )
        _, hit, boundary = self.manager.get_computed_blocks(request)
        coordinator = self.manager.coordinator
        if isinstance(coordinator, HybridKVCacheCoordinator):
            _, per_group = coordinator.find_longest_cache_hit_per_group(
                request.block_hashes, request.num_tokens - 1
            )
        else:
            per_group = (hit,)
        return Lookup(hit=hit, per_group=tuple(per_group), shared_prefix_boundary=boundary)

    def submit(
        self,
        tokens: Sequence[int],
        outputs: Sequence[int],
        namespace: Namespace | None = None,
        *,
        report_mode: str | None = None,
        on_finish: Callable[[Request], None] | None = None,
    ) -> Request:
        """Queue a request that will generate exactly `outputs` (at least one token)."""
        if not outputs:
            raise ValueError("a request generates at least one token")
        request = self.make_request(
            tokens, namespace, max_tokens=len(outputs), report_mode=report_mode
        )
        self._waiting.append(_Running(request, list(outputs), on_finish))
        return request

    def run_request(
        self,
        tokens: Sequence[int],
        outputs: Sequence[int],
        namespace: Namespace | None = None,
        *,
        report_mode: str | None = None,
    ) -> Request:
        """Submit a request and step until it finishes (other queued work runs alongside)."""
        request = self.submit(tokens, outputs, namespace, report_mode=report_mode)
        while not request.is_finished():
            if not self.step():
                raise RuntimeError(f"{request.request_id} cannot make progress")
        return request

    @property
    def idle(self) -> bool:
        return not self._running and not self._waiting

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset; succeeds only when no request holds blocks. Flushes its event."""
        ok = self.manager.reset_prefix_cache()
        if ok:
            self.stats.resets += 1
        else:
            self.stats.failed_resets += 1
        self._flush_events()
        return ok

    def take_batches(self) -> list[KVEventBatch]:
        """The batches produced since the last call, in publication order."""
        batches, self._batches = self._batches, []
        return batches

    # ---- one engine step ----------------------------------------------------------------------

    def step(self) -> bool:
        """Run one engine step. Returns False when nothing could be scheduled."""
        if self.idle:
            return False
        manager = self.manager
        manager.new_step_starts()
        budget = self.config.max_num_scheduled_tokens
        scheduled: list[tuple[_Running, int]] = []

        # Running requests first, in order; preempt from the back when the pool is full.
        index = 0
        while index < len(self._running) and budget > 0:
            item = self._running[index]
            request = item.request
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            n = min(n, self.config.max_model_len - request.num_computed_tokens - 1)
            n = self._aligned_split(request, n)
            if n <= 0:
                index += 1
                continue
            while True:
                if manager.allocate_slots(request, n) is not None:
                    scheduled.append((item, n))
                    budget -= n
                    index += 1
                    break
                victim = self._running.pop()
                self._preempt(victim)
                scheduled = [(s, k) for s, k in scheduled if s is not victim]
                if victim is item:
                    break

        # Then waiting requests (new or preempted), while the pool and budget allow.
        while self._waiting and budget > 0:
            item = self._waiting[0]
            request = item.request
            if request.num_computed_tokens != 0:
                raise AssertionError("waiting requests restart from a prefix lookup")
            blocks, hit, boundary = manager.get_computed_blocks(request)
            request.shared_prefix_boundary = boundary
            n = min(request.num_tokens - hit, budget)
            n = self._aligned_split(request, n, hit)
            if n <= 0:
                break
            new_blocks = manager.allocate_slots(
                request,
                n,
                num_new_computed_tokens=hit,
                new_computed_blocks=blocks,
                has_scheduled_reqs=bool(self._running),
            )
            if new_blocks is None:
                # Pool full, or a Mamba state this step produced: retry next step.
                self.stats.deferred_admissions += 1
                break
            self._waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = hit
            self._running.append(item)
            scheduled.append((item, n))
            budget -= n

        # What the scheduler drains right after scheduling (reference §9.3, "ending a step").
        manager.take_boundary_state_offloads()
        _, retained = manager.take_kv_cache_block_copies()
        if retained:
            manager.block_pool.free_blocks(retained)

        # "Execute" the step: advance, sample where a prefill or decode completes, finish.
        for item, n in scheduled:
            request = item.request
            request.num_computed_tokens += n
            if request.num_computed_tokens >= request.num_tokens:
                request.append_output_token_ids(item.outputs[request.num_output_tokens])
                if request.num_output_tokens >= len(item.outputs):
                    self._finish(item)
        self.stats.steps += 1
        self._flush_events()
        return bool(scheduled)

    def _aligned_split(self, request: Request, n: int, local_hit: int = 0) -> int:
        if self._split_self is None or n <= 0:
            return n
        return int(Scheduler._mamba_block_aligned_split(self._split_self, request, n, local_hit))

    def _preempt(self, item: _Running) -> None:
        request = item.request
        self.manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._waiting.appendleft(item)
        self.stats.preemptions += 1

    def _finish(self, item: _Running) -> None:
        request = item.request
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        self.manager.free(request)
        self._running.remove(item)
        self.stats.finished += 1
        if item.on_finish is not None:
            item.on_finish(request)

    def _flush_events(self) -> None:
        events = self.manager.take_events()
        if not events:
            return
        for event in events:
            name = type(event).__name__
            self.stats.events[name] = self.stats.events.get(name, 0) + 1
        batch = KVEventBatch(ts=self._clock(), events=events)
        self.stats.batches += 1
        if self._publish is not None:
            self._publish(batch)
        self._batches.append(batch)
