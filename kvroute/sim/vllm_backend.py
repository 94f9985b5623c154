"""vLLM's real KV cache manager as a simulated engine's cache, driven like vLLM's scheduler.

The one place in kvroute that drives vLLM's `KVCacheManager`: the simulated engine
(`kvroute sim --cache-backend vllm`), the sim's differential test against SimCache
(tests/sim/vllm_agreement_runner.py) and the conformance driver (tests/conformance) all use it.

- `VllmCacheBackend` wraps a real `vllm.v1.core.kv_cache_manager.KVCacheManager` (no model, no
  GPU) behind the simulated engine's cache protocol (`kvroute/sim/cache_api.py`): add a
  request, look up its prefix hit, clip a chunk with the scheduler's own Mamba block-aligned
  split, allocate, advance, append tokens, free, and end a step with the drains the scheduler
  does. It also answers vLLM's native hit for any prompt without allocating (`native_hit`).
- `SchedulerLoop` runs requests through it the way vLLM's scheduler does (running requests
  first, preemption from the back when the pool is full, admission of waiting requests, decode)
  and hands each step's events out as vLLM's own `KVEventBatch`.

Importable only inside the vLLM environment (.venv-vllm). The recipe is
docs/reference/vllm-kv-events.md §9.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType, SimpleNamespace
from typing import Any

import msgspec
import torch
from vllm.distributed.kv_events import KVCacheEvent, KVEventBatch
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
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

from kvroute.sim import events as sim_events
from kvroute.sim.cache_api import CacheRequest, Lookup

GROUP_KINDS = ("full_attention", "sliding_window", "mamba", "circular_buffer")

# ---- configuration (field names as in kvroute.sim.cache_api's GroupSpec / CacheSpec)
# -----------------


@dataclass(frozen=True)
class GroupConfig:
    """One KV cache group: its kind, block size and (for sliding window) window."""

    kind: str
    block_size: int
    sliding_window: int | None = None


@dataclass(frozen=True)
class BackendConfig:
    """A worker's cache layout and scheduling limits."""

    groups: tuple[GroupConfig, ...]
    num_blocks: int = 64
    max_model_len: int = 8192
    prefix_match_unit: int | None = None
    # vLLM's prefix_cache_retention_interval: 0 is the engine default (sparse), None is dense.
    retention_interval: int | None = 0
    # Token budget of one engine step (max_num_batched_tokens).
    max_num_scheduled_tokens: int = 128
    hash_algo: str = "sha256"


def _spec_of(group: Any) -> KVCacheSpec:
    attention: dict[str, Any] = {
        "block_size": group.block_size,
        "num_kv_heads": 1,
        "head_size": 8,
        "dtype": torch.float16,
    }
    if group.kind in ("full_attention", "mla_attention"):
        return FullAttentionSpec(**attention)
    if group.kind == "sliding_window":
        if not group.sliding_window:
            raise ValueError("sliding_window groups need a window")
        return SlidingWindowSpec(**attention, sliding_window=group.sliding_window)
    if group.kind == "mamba":
        return MambaSpec(
            block_size=group.block_size,
            shapes=((1, 8),),
            dtypes=(torch.float16,),
            mamba_cache_mode="align",
        )
    if group.kind == "circular_buffer":
        # Not prefix-cacheable: it emits no events but still enters the LCM.
        return CircularBufferSpec(**attention)
    raise ValueError(f"unknown group kind {group.kind!r}; expected one of {GROUP_KINDS}")


def scheduler_block_size(spec: Any) -> int:
    """vLLM's scheduler block size: the LCM of every group's block size (§7.2)."""
    return math.lcm(*(g.block_size for g in spec.groups))


def hash_block_size(spec: Any) -> int:
    """vLLM's hash block size: one group's block, else prefix_match_unit or the GCD (§7.2)."""
    if len(spec.groups) == 1:
        return int(spec.groups[0].block_size)
    if spec.prefix_match_unit is not None:
        return int(spec.prefix_match_unit)
    return math.gcd(*(g.block_size for g in spec.groups if g.kind != "circular_buffer"))


def describe(spec: Any) -> dict[str, Any]:
    """A plain-data description of a layout (for recordings and logs)."""
    return {
        "groups": [
            {"kind": g.kind, "block_size": g.block_size, "sliding_window": g.sliding_window}
            for g in spec.groups
        ],
        "num_blocks": spec.num_blocks,
        "retention_interval": spec.retention_interval,
        "prefix_match_unit": spec.prefix_match_unit,
        "max_model_len": spec.max_model_len,
        "max_num_scheduled_tokens": spec.max_num_scheduled_tokens,
        "hash_algo": getattr(spec, "hash_algo", "sha256"),
        "scheduler_block_size": scheduler_block_size(spec),
        "hash_block_size": hash_block_size(spec),
    }


# ---- requests and answers -------------------------------------------------------------------


@dataclass(frozen=True)
class Namespace:
    """What a prompt's blocks are cached under besides its tokens."""

    lora_name: str = ""
    cache_salt: str = ""
    # vLLM hashes the adapter's path too but never publishes it; empty means a default path.
    lora_path: str = ""


@dataclass(frozen=True, slots=True)
class VllmRequest(CacheRequest):
    """A `kvroute.sim.cache_api.CacheRequest` with per-request settings only vLLM honours (the
    conformance driver's limit scenarios): the KV report mode and prompt logprobs."""

    kv_cache_report_mode: str | None = None
    prompt_logprobs: int | None = None


@dataclass(frozen=True)
class NativeHit:
    """vLLM's answer for a prompt: the joint hit and each group's own longest hit."""

    hit: int
    per_group: tuple[int, ...]
    shared_prefix_boundary: int


# ---- events ---------------------------------------------------------------------------------


def to_sim_event(event: KVCacheEvent) -> sim_events.KvEvent:
    """vLLM's event object as the `kvroute.sim.events` record of the same name, field by field.

    Raises TypeError for an event type or a set field that the records do not know, so a vLLM
    upgrade that adds one fails loudly here instead of publishing less than vLLM would.
    """
    cls = getattr(sim_events, type(event).__name__, None)
    if cls not in (sim_events.BlockStored, sim_events.BlockRemoved, sim_events.AllBlocksCleared):
        raise TypeError(f"no kvroute.sim.events record for vLLM event {type(event).__name__}")
    known = {f.name for f in msgspec.structs.fields(cls)}
    values: dict[str, Any] = {}
    for f in msgspec.structs.fields(type(event)):
        value = getattr(event, f.name)
        if f.name not in known:
            if value is None or value == f.default:
                continue
            raise TypeError(
                f"vLLM's {type(event).__name__}.{f.name} has no kvroute.sim.events field"
            )
        if f.name in ("block_hashes", "token_ids"):
            value = list(value)
        elif f.name == "extra_keys" and value is not None:
            value = [None if key is None else tuple(key) for key in value]
        elif f.name == "lookahead_token_ids" and value is not None:
            value = [list(tokens) for tokens in value]
        values[f.name] = value
    record: sim_events.KvEvent = cls(**values)
    return record


# ---- the backend ----------------------------------------------------------------------------


class VllmCacheBackend:
    """A real vLLM KVCacheManager behind the simulated engine's cache protocol."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        hash_fn = get_hash_fn_by_name(getattr(spec, "hash_algo", "sha256"))
        # vLLM's seed hash is process-wide (one engine per process): backends living together
        # in one process must use the same hash algorithm.
        kv_cache_utils.init_none_hash(hash_fn)
        self.scheduler_block_size = scheduler_block_size(spec)
        self.hash_block_size = hash_block_size(spec)
        self._hasher = kv_cache_utils.get_request_block_hasher(self.hash_block_size, hash_fn)
        kv_config = KVCacheConfig(
            num_blocks=spec.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec([f"layer{i}"], _spec_of(g)) for i, g in enumerate(spec.groups)
            ],
            prefix_cache_retention_interval=spec.retention_interval,
        )
        self.manager = KVCacheManager(
            kv_config,
            max_model_len=spec.max_model_len,
            scheduler_block_size=self.scheduler_block_size,
            hash_block_size=self.hash_block_size,
            max_in_flight_tokens=getattr(spec, "max_in_flight_tokens", None),
            enable_caching=getattr(spec, "enable_caching", True),
            enable_kv_cache_events=True,
        )
        self.partial_hits = bool(self.manager.coordinator.enable_partial_hash_hits)
        # The hit granularity vLLM uses (§7.3).
        self.alignment = self.hash_block_size if self.partial_hits else self.scheduler_block_size
        mamba = [g for g in spec.groups if g.kind == "mamba"]
        # Stand-in for the scheduler: `_mamba_block_aligned_split` reads only these (§9.3).
        self._split_self = (
            SimpleNamespace(
                cache_config=SimpleNamespace(block_size=mamba[0].block_size),
                block_size=self.scheduler_block_size,
                hash_block_size=self.hash_block_size,
                mamba_partial_cache_hit=(
                    self.hash_block_size < self.scheduler_block_size and self.partial_hits
                ),
                use_eagle_block_drop=False,
                num_hash_lookahead_tokens=0,
                mamba_has_prefill_checkpoint_blocks=False,
                mamba_prefill_checkpoint_alignment=None,
                max_num_scheduled_tokens=spec.max_num_scheduled_tokens,
                scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
                mamba_shared_prefix_checkpoint=False,
            )
            if mamba
            else None
        )
        self._requests: dict[str, Request] = {}
        self._lora_ids: dict[str, int] = {}
        self._probe_ids = itertools.count()

    # ---- the protocol (sim-cache-protocol.md) -----------------------------------------------

    def add_request(self, req: Any) -> None:
        """Create the vLLM request (its block hashes are computed here)."""
        if req.request_id in self._requests:
            raise ValueError(f"request {req.request_id!r} already exists")
        self._requests[req.request_id] = self._make_request(req)

    def lookup(self, request_id: str) -> Lookup:
        """`get_computed_blocks`, recording the shared-prefix boundary like the scheduler."""
        request = self._requests[request_id]
        blocks, hit, boundary = self.manager.get_computed_blocks(request)
        request.shared_prefix_boundary = boundary
        return Lookup(hit, boundary, blocks)

    def split_chunk(self, request_id: str, num_new_tokens: int, num_local_hit: int = 0) -> int:
        """The scheduler's `_mamba_block_aligned_split` (the identity without Mamba)."""
        if self._split_self is None or num_new_tokens <= 0:
            return num_new_tokens
        request = self._requests[request_id]
        return int(
            Scheduler._mamba_block_aligned_split(
                self._split_self, request, num_new_tokens, num_local_hit
            )
        )

    def allocate(self, request_id: str, num_new_tokens: int, lookup: Lookup | None = None) -> bool:
        """`allocate_slots`; with the first chunk's lookup, adopt its hit. False = no room.

        An admission (with `lookup`) checks that the whole sequence fits, as vLLM does by
        default (`scheduler_reserve_full_isl`).
        """
        request = self._requests[request_id]
        if lookup is None:
            return self.manager.allocate_slots(request, num_new_tokens) is not None
        blocks = lookup.handle
        assert isinstance(blocks, KVCacheBlocks)
        allocated = self.manager.allocate_slots(
            request,
            num_new_tokens,
            num_new_computed_tokens=lookup.hit_tokens,
            new_computed_blocks=blocks,
            full_sequence_must_fit=True,
        )
        if allocated is None:
            return False
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = lookup.hit_tokens
        return True

    def advance(self, request_id: str, num_tokens: int) -> None:
        self._requests[request_id].num_computed_tokens += num_tokens

    def append_token(self, request_id: str, token_id: int) -> None:
        self._requests[request_id].append_output_token_ids(token_id)

    def free(self, request_id: str) -> None:
        """The request finished or was aborted: release its blocks (emits nothing)."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.manager.free(request)

    def block_ids(self, request_id: str) -> list[list[int]]:
        """vLLM's own block ids of the request, one list per group."""
        return [list(ids) for ids in self.manager.get_block_ids(request_id)]

    def preempt(self, request_id: str) -> None:
        """Release a running request's blocks but keep it (prompt and outputs) to resume."""
        request = self._requests[request_id]
        self.manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1

    def begin_step(self) -> None:
        """A new engine step starts (vLLM's scheduler calls this first in `schedule`)."""
        self.manager.new_step_starts()

    def end_schedule(self) -> None:
        """What the scheduler drains right after scheduling a step: boundary-state offloads
        and block copies (their retained copy-on-write blocks go back to the pool). Call it
        before freeing the step's finished requests, as vLLM does."""
        manager = self.manager
        manager.take_boundary_state_offloads()
        _, retained = manager.take_kv_cache_block_copies()
        if retained:
            manager.block_pool.free_blocks(retained)

    def end_step(self) -> list[sim_events.KvEvent]:
        """The step's events as `kvroute.sim.events` records (the bridge's msgspec records, vLLM's
        field names), ready for the simulated engine's publisher."""
        return [to_sim_event(e) for e in self.end_step_vllm()]

    def end_step_vllm(self) -> list[KVCacheEvent]:
        """The step's events as vLLM's own objects, in the block pool's order."""
        return list(self.manager.take_events())

    def reset(self) -> bool:
        """`reset_prefix_cache`: only when no request holds blocks; its event comes next step."""
        return bool(self.manager.reset_prefix_cache())

    def usage(self) -> float:
        return float(self.manager.usage)

    def per_group_hits(self, request_id: str) -> list[int]:
        request = self._requests[request_id]
        return list(self._per_group(request))

    # ---- extras ---------------------------------------------------------------------------

    def request(self, request_id: str) -> Request:
        return self._requests[request_id]

    @property
    def requests(self) -> Mapping[str, Request]:
        """The live vLLM requests by id (read-only view, for traces and tests)."""
        return MappingProxyType(self._requests)

    def native_hit(
        self,
        tokens: Sequence[int],
        namespace: Namespace | None = None,
        *,
        prompt_logprobs: int | None = None,
    ) -> NativeHit:
        """vLLM's own hit for a prompt, without allocating or adding anything (§9.3)."""
        ns = namespace or Namespace()
        probe = VllmRequest(
            request_id=f"probe-{next(self._probe_ids)}",
            prompt_token_ids=tuple(tokens),
            lora_name=ns.lora_name or None,
            lora_path=ns.lora_path or None,
            cache_salt=ns.cache_salt or None,
            max_tokens=1,
            prompt_logprobs=prompt_logprobs,
        )
        request = self._make_request(probe)
        _, hit, boundary = self.manager.get_computed_blocks(request)
        return NativeHit(hit, self._per_group(request, hit), boundary)

    def _per_group(self, request: Request, joint: int | None = None) -> tuple[int, ...]:
        coordinator = self.manager.coordinator
        if isinstance(coordinator, HybridKVCacheCoordinator):
            _, hits = coordinator.find_longest_cache_hit_per_group(
                request.block_hashes, request.num_tokens - 1
            )
            return tuple(hits)
        if joint is None:
            _, joint, _ = self.manager.get_computed_blocks(request)
        return (joint,)

    def _make_request(self, req: Any) -> Request:
        lora = None
        if req.lora_name:
            lora_id = req.lora_id or self._lora_ids.setdefault(
                req.lora_name, len(self._lora_ids) + 1
            )
            lora = LoRARequest(
                req.lora_name, lora_id, req.lora_path or f"/adapters/{req.lora_name}"
            )
        mode = getattr(req, "kv_cache_report_mode", None)
        params = SamplingParams(
            max_tokens=req.max_tokens,
            extra_args={"kv_cache_report_mode": mode} if mode else None,
            prompt_logprobs=getattr(req, "prompt_logprobs", None),
        )
        return Request(
            req.request_id,
            list(req.prompt_token_ids),
            params,
            None,
            lora_request=lora,
            cache_salt=req.cache_salt or None,
            block_hasher=self._hasher,
        )


# ---- a scheduler-like loop over the backend ---------------------------------------------------


@dataclass
class _Work:
    request_id: str
    outputs: list[int]
    on_finish: Callable[[Request], None] | None = None


@dataclass
class LoopStats:
    steps: int = 0
    batches: int = 0
    preemptions: int = 0
    deferred_admissions: int = 0
    resets: int = 0
    failed_resets: int = 0
    finished: int = 0
    events: dict[str, int] = field(default_factory=dict)


class SchedulerLoop:
    """Runs requests through a `VllmCacheBackend` step by step as vLLM's scheduler does, and
    collects each step's events as a vLLM `KVEventBatch` (also handed to `publish`)."""

    def __init__(
        self,
        backend: VllmCacheBackend,
        *,
        clock: Callable[[], float] = time.time,
        publish: Callable[[KVEventBatch], None] | None = None,
    ) -> None:
        self.backend = backend
        self._clock = clock
        self._publish = publish
        self._running: list[_Work] = []
        self._waiting: deque[_Work] = deque()
        self._ids = itertools.count()
        self._batches: list[KVEventBatch] = []
        self.stats = LoopStats()

    @property
    def idle(self) -> bool:
        return not self._running and not self._waiting

    def submit(
        self,
        tokens: Sequence[int],
        outputs: Sequence[int],
        namespace: Namespace | None = None,
        *,
        report_mode: str | None = None,
        on_finish: Callable[[Request], None] | None = None,
    ) -> str:
        """Queue a request that will generate exactly `outputs` (at least one token)."""
        if not outputs:
            raise ValueError("a request generates at least one token")
        ns = namespace or Namespace()
        request_id = f"req-{next(self._ids)}"
        self.backend.add_request(
            VllmRequest(
                request_id=request_id,
                prompt_token_ids=tuple(tokens),
                lora_name=ns.lora_name or None,
                lora_path=ns.lora_path or None,
                cache_salt=ns.cache_salt or None,
                max_tokens=len(outputs),
                kv_cache_report_mode=report_mode,
            )
        )
        self._waiting.append(_Work(request_id, list(outputs), on_finish))
        return request_id

    def run_request(
        self,
        tokens: Sequence[int],
        outputs: Sequence[int],
        namespace: Namespace | None = None,
        *,
        report_mode: str | None = None,
    ) -> list[int]:
        """Submit a request and step until it finishes; returns prompt + generated tokens."""
        done: list[Request] = []
        self.submit(tokens, outputs, namespace, report_mode=report_mode, on_finish=done.append)
        while not done:
            if not self.step():
                raise RuntimeError("the request cannot make progress (pool too small?)")
        return list(done[0].prompt_token_ids or []) + list(done[0].output_token_ids)

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset (succeeds only when idle); its event is published right away."""
        ok = self.backend.reset()
        if ok:
            self.stats.resets += 1
        else:
            self.stats.failed_resets += 1
        self._emit(self.backend.end_step_vllm())
        return ok

    def take_batches(self) -> list[KVEventBatch]:
        """The batches produced since the last call, in publication order."""
        batches, self._batches = self._batches, []
        return batches

    def step(self) -> bool:
        """Run one engine step. Returns False when nothing could be scheduled."""
        if self.idle:
            return False
        backend = self.backend
        backend.begin_step()
        budget = self.backend.spec.max_num_scheduled_tokens
        scheduled: list[tuple[_Work, int]] = []

        # Running requests first, in order; preempt from the back when the pool is full.
        index = 0
        while index < len(self._running) and budget > 0:
            work = self._running[index]
            request = backend.request(work.request_id)
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            n = min(n, backend.spec.max_model_len - request.num_computed_tokens - 1)
            n = backend.split_chunk(work.request_id, n)
            if n <= 0:
                index += 1
                continue
            while not backend.allocate(work.request_id, n):
                victim = self._running.pop()
                backend.preempt(victim.request_id)
                self._waiting.appendleft(victim)
                self.stats.preemptions += 1
                if victim is work:
                    break
            else:
                scheduled.append((work, n))
                budget -= n
                index += 1

        # Then waiting requests (new or preempted), while the pool and the budget allow.
        while self._waiting and budget > 0:
            work = self._waiting[0]
            request = backend.request(work.request_id)
            lookup = backend.lookup(work.request_id)
            n = min(request.num_tokens - lookup.hit_tokens, budget)
            n = backend.split_chunk(work.request_id, n, lookup.hit_tokens)
            if n <= 0:
                break
            if not backend.allocate(work.request_id, n, lookup):
                # Pool full, or a Mamba state this very step produced: retry next step.
                self.stats.deferred_admissions += 1
                break
            self._waiting.popleft()
            self._running.append(work)
            scheduled.append((work, n))
            budget -= n

        backend.end_schedule()
        # "Execute": advance, sample where a prefill or decode completes, finish.
        finished: list[_Work] = []
        for work, n in scheduled:
            backend.advance(work.request_id, n)
            request = backend.request(work.request_id)
            if request.num_computed_tokens >= request.num_tokens:
                backend.append_token(work.request_id, work.outputs[request.num_output_tokens])
                if request.num_output_tokens >= len(work.outputs):
                    finished.append(work)
        for work in finished:
            request = backend.request(work.request_id)
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            backend.free(work.request_id)
            self._running.remove(work)
            self.stats.finished += 1
            if work.on_finish is not None:
                work.on_finish(request)
        self.stats.steps += 1
        self._emit(backend.end_step_vllm())
        return bool(scheduled)

    def _emit(self, events: list[KVCacheEvent]) -> None:
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
