"""The simulated engine: scheduler + cache + modelled GPU time, as an asyncio task.

Requests are submitted from the HTTP layer (same event loop) and stream back one token per
step. Each step: apply aborts and control actions, schedule, sleep for the modelled GPU time
(divided by `speed`, multiplied by a slowdown fault), apply the results, publish the step's KV
events, hand tokens to the waiting requests. Steps are paced against a running clock so that
many short steps do not drift.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

from kvroute.sim.cache import SimCache
from kvroute.sim.cache_api import CacheBackend, CacheRequest, CacheSpec, GroupSpec
from kvroute.sim.engine.generation import OutputStream, word_token_ids
from kvroute.sim.engine.kv_transfer import KvTransfer, TransferConfig
from kvroute.sim.engine.metrics import EngineMetrics
from kvroute.sim.engine.scheduler import Scheduler, StepPlan
from kvroute.sim.events import KvEvent
from kvroute.sim.model import MODEL_DIR
from kvroute.sim.offload import OffloadConfig, OffloadConnector, check_offloadable
from kvroute.sim.profiles import profile_groups
from kvroute.sim.publisher import EventPublisher
from kvroute.sim.timing import DEFAULT_GPU, GpuModel, chunk_context
from kvroute.sim.tokenizer import SimTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything that shapes one simulated engine (model, cache layout, limits, speed)."""

    model: str = "kvroute-sim"
    lora_adapters: tuple[str, ...] = ()
    profile: str = "dense"
    groups: tuple[GroupSpec, ...] | None = None  # overrides the profile
    sliding_window: int | None = None
    num_blocks: int = 4096
    max_model_len: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_waiting: int = 4096  # bound on queued requests; more are refused (503)
    retention_interval: int | None = 0
    speed: float = 1.0
    seed: int = 0  # mixed into every request's generation seed
    gpu: GpuModel = DEFAULT_GPU
    model_dir: str = str(MODEL_DIR)
    # "generate", or "pooling": an embedding model (a decoder with last-token pooling, which
    # vLLM serves with prefix caching on: its embed requests read and fill the cache)
    runner: str = "generate"
    kv_transfer: TransferConfig | None = None  # prefill/decode disaggregation (None: off)
    cpu_offload: OffloadConfig | None = None  # vLLM's native CPU tier (None: off)

    def cache_spec(self) -> CacheSpec:
        """The cache layout and limits; ValueError if one max_model_len request cannot fit."""
        groups = self.groups or profile_groups(self.profile, self.sliding_window)
        spec = CacheSpec(
            groups=groups,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            retention_interval=self.retention_interval,
            max_num_scheduled_tokens=self.max_num_batched_tokens,
            max_in_flight_tokens=self.max_num_batched_tokens,
        )
        if self.cpu_offload is not None:
            check_offloadable(spec)
        need = sum(-(-self.max_model_len // g.block_size) for g in groups) + 1
        if self.num_blocks < need:
            raise ValueError(
                f"num_blocks={self.num_blocks} cannot hold one max_model_len={self.max_model_len}"
                f" request ({need} blocks); raise --num-blocks or lower --max-model-len"
            )
        return spec

    def lora_id(self, name: str) -> int | None:
        """The engine's id of a LoRA adapter (1, 2, ... in the configured order), or None."""
        return self.lora_adapters.index(name) + 1 if name in self.lora_adapters else None

    def lora_path(self, name: str) -> str:
        """Where a LoRA adapter is said to be loaded from (part of its block hashes)."""
        return f"/adapters/{name}"


@dataclass(slots=True)
class GenerateRequest:
    """One generation request as the engine takes it (prompt tokenized, checks done)."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    kv_transfer_params: Mapping[str, object] | None = None
    external_end: int = 0  # prompt tokens up to here were pulled from a prefill peer
    cached_tokens_reported: int | None = None  # what usage reports instead of the local hit
    pulled_blocks: int = 0  # KV blocks this engine pulled from the prefill peer for it


@dataclass(slots=True)
class TokenOutput:
    """One step's output for a request (or its end)."""

    token_id: int | None
    text: str  # new text since the previous output
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None
    error: str | None = None


@dataclass(slots=True)
class RequestHandle:
    """A submitted request: its output queue and what the API reports about it."""

    request: GenerateRequest
    arrival: float
    queue: asyncio.Queue[TokenOutput] = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    cached_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    admitted_at: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    kv_transfer_params: dict[str, object] | None = None  # a producer's answer for its peer
    run_prompt_len: int = 0  # prompt tokens the engine runs (a Mamba prefill half: one fewer)

    @property
    def request_id(self) -> str:
        return self.request.request_id


class EngineError(RuntimeError):
    """The engine cannot take or finish the request (restart, injected failure)."""


class EngineOverloaded(EngineError):
    """The waiting queue is at its bound (EngineConfig.max_waiting)."""


class Engine:
    """One simulated engine: scheduler, cache and modelled GPU time (see the module doc)."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: SimTokenizer | None = None,
        publisher: EventPublisher | None = None,
        cache_factory: Callable[[CacheSpec], CacheBackend] = SimCache,
    ) -> None:
        self.config = config
        self._cache_factory = cache_factory
        self.tokenizer = tokenizer or SimTokenizer(config.model_dir)
        self.publisher = publisher
        self.metrics = EngineMetrics(config.model)
        self.metrics.cache_config(config.cache_spec())
        if config.cpu_offload is not None:
            self.metrics.offloading()
        self._vocab = word_token_ids(self.tokenizer)
        self._new_core()
        self.handles: dict[str, RequestHandle] = {}
        self._streams: dict[str, OutputStream] = {}
        self._aborts: list[str] = []
        self._reset_requested: asyncio.Future[bool] | None = None
        self._wake = asyncio.Event()
        self._unhung = asyncio.Event()
        self._unhung.set()
        self.slowdown = 1.0
        self.steps = 0
        self.rejected = 0
        self.peak_waiting = 0  # the longest the waiting queue has been at a submit
        self.busy_seconds = 0.0
        self._task: asyncio.Task[None] | None = None
        self.kv: KvTransfer | None = None
        if config.kv_transfer is not None:
            self.kv = KvTransfer(
                config.kv_transfer,
                engine_id=f"sim-{uuid.uuid4().hex}",
                block_size=config.cache_spec().scheduler_block_size,
                kv_bytes_per_token=config.gpu.kv_bytes_per_token,
                speed=config.speed,
                max_leases=config.num_blocks,
                has_mamba=config.cache_spec().mamba_block_size is not None,
            )

    def _new_core(self) -> None:
        spec = self.config.cache_spec()
        self.cache: CacheBackend = self._cache_factory(spec)
        offload = None
        if self.config.cpu_offload is not None:
            if not isinstance(self.cache, SimCache):
                raise ValueError("the CPU tier runs on the sim cache backend only")
            offload = OffloadConnector(
                self.config.cpu_offload, spec, self.cache, self.config.gpu.kv_bytes_per_token
            )
        self.scheduler = Scheduler(
            self.cache,
            max_num_seqs=self.config.max_num_seqs,
            max_num_scheduled_tokens=self.config.max_num_batched_tokens,
            offload=offload,
        )
        # request -> (loop time its CPU-tier load is done, its bytes, the seconds it takes)
        self._loads: dict[str, tuple[float, float, float]] = {}
        self._reported_queries = self._reported_hits = self._reported_preempt = 0

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine loop (a task on the running event loop)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        """Stop the loop; requests in flight end as aborted."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for handle in list(self.handles.values()):
            self._end(handle, "abort", error="engine stopped")

    # ---- requests -----------------------------------------------------------------------
    def submit(self, req: GenerateRequest) -> RequestHandle:
        """Queue a request; its tokens arrive on the handle's queue. EngineOverloaded when the
        waiting queue is full, EngineError for a duplicate id."""
        if req.request_id in self.handles:
            raise EngineError(f"request id {req.request_id!r} is already running")
        if self.scheduler.num_waiting >= self.config.max_waiting:
            self.rejected += 1
            raise EngineOverloaded(
                f"the engine already has {self.config.max_waiting} requests waiting; retry later"
            )
        keep = self.kv is not None and self.kv.config.produces(req.kv_transfer_params)
        prompt_ids = req.prompt_ids
        if keep and self.kv is not None:
            prompt_ids = prompt_ids[: self.kv.prefill_tokens(len(prompt_ids))]
        handle = RequestHandle(req, arrival=time.monotonic(), run_prompt_len=len(prompt_ids))
        request = self._cache_request(req.request_id, prompt_ids, req.lora_name, req.cache_salt)
        self.scheduler.add(
            dataclasses.replace(request, max_tokens=max(1, req.max_tokens)),
            external_end=req.external_end,
            keep=keep,
        )
        self.peak_waiting = max(self.peak_waiting, self.scheduler.num_waiting)
        self.handles[req.request_id] = handle
        self._streams[req.request_id] = OutputStream(
            req.prompt_ids,
            self._vocab,
            self.tokenizer.eos_token_id,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            engine_seed=self.config.seed,
        )
        self._update_gauges()
        self._wake.set()
        return handle

    async def pull_prompt(self, req: GenerateRequest) -> GenerateRequest:
        """For a decode request (`do_remote_prefill`): pull the prompt's blocks this engine
        lacks from the prefill peer (taking the modelled transfer time) and return the request
        to submit; any other request comes back unchanged."""
        kv, params = self.kv, req.kv_transfer_params
        if kv is None or params is None or not kv.config.consumes(params):
            return req
        hit, _ = self.probe(req.prompt_ids, req.lora_name, req.cache_salt)
        pulled = await kv.pull(params, len(req.prompt_ids), hit)
        # vLLM reports the prefill peer's cache hit, not the decode's (near) full one
        reported = params.get("remote_prefill_cached_tokens")
        if not isinstance(reported, int) or isinstance(reported, bool):
            reported = None
        end = hit + pulled.external_tokens if pulled.external_tokens else 0
        return dataclasses.replace(
            req, external_end=end, cached_tokens_reported=reported, pulled_blocks=pulled.blocks
        )

    def abort(self, request_id: str) -> None:
        """The client went away: drop the request at the next step boundary."""
        if request_id in self.handles:
            self._aborts.append(request_id)
            self._wake.set()

    def wake(self) -> None:
        """Have the loop run its control step soon (e.g. to free blocks a peer pulled)."""
        self._wake.set()

    def probe(
        self, prompt_ids: Sequence[int], lora_name: str | None, cache_salt: str | None
    ) -> tuple[int, list[int]]:
        """(hit, per-group hits) this prompt would get if admitted now; no side effects."""
        rid = f"probe-{uuid.uuid4().hex}"
        self.cache.add_request(self._cache_request(rid, prompt_ids, lora_name, cache_salt))
        try:
            hit = self.cache.lookup(rid).hit_tokens
            offload = self.scheduler.offload
            if offload is not None:  # vLLM reports tokens loaded from the CPU tier as cached
                hit += offload.peek(rid, hit, len(prompt_ids))
            return hit, self.cache.per_group_hits(rid)
        finally:
            self.cache.free(rid)

    def _cache_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        lora_name: str | None,
        cache_salt: str | None,
    ) -> CacheRequest:
        """A prompt as the cache sees it (a LoRA adapter gets its id and path here)."""
        return CacheRequest(
            request_id,
            tuple(prompt_ids),
            lora_name=lora_name,
            lora_id=self.config.lora_id(lora_name) if lora_name else None,
            lora_path=self.config.lora_path(lora_name) if lora_name else None,
            cache_salt=cache_salt,
        )

    async def reset_prefix_cache(self) -> bool:
        """vLLM's reset_prefix_cache at the next step boundary (False if blocks are in use)."""
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._reset_requested = fut
        self._wake.set()
        return await fut

    def restart(self) -> None:
        """Like an engine crash + restart: in-flight requests fail, the cache is empty, the
        event sequence starts again at 0."""
        for handle in list(self.handles.values()):
            self._end(handle, "error", error="engine restarted")
        self._aborts.clear()
        self._new_core()
        if self.kv is not None:
            self.kv.drop_all()
        if self.publisher is not None:
            self.publisher.restart()
        self._update_gauges()

    # ---- faults ---------------------------------------------------------------------------
    def set_hang(self, hang: bool) -> None:
        """Freeze (or release) the engine loop and the gated API routes."""
        if hang:
            self._unhung.clear()
        else:
            self._unhung.set()

    @property
    def hung(self) -> bool:
        """Whether the engine is frozen by the hang fault."""
        return not self._unhung.is_set()

    async def wait_unhung(self) -> None:
        """Wait until the engine is not frozen."""
        await self._unhung.wait()

    # ---- the loop ---------------------------------------------------------------------------
    async def _run(self) -> None:
        # The steps keep the GPU's schedule, as vLLM's EngineCore does in its own process:
        # while this event loop is busy elsewhere (the API side parsing and tokenizing a
        # request, which vLLM does in the API server process), the modelled GPU keeps
        # stepping, and a request takes part in a step only if it arrived before the step
        # began (vLLM's busy loop reads its input queue between steps). Without this, a
        # request tokenized while a step was due was admitted at once (its tokenizing hidden
        # in the wait for the step) and every other request's step was stretched by it.
        loop = asyncio.get_running_loop()
        next_t = loop.time()
        while True:
            if self.hung:
                await self._unhung.wait()
                next_t = loop.time()  # the GPU was frozen too: no catching up afterwards
            self._apply_control()
            self._finish_loads(loop.time())
            if not self.scheduler.has_work():
                self._publish(self.scheduler.flush_offload())
                self._wake.clear()
                if self.kv is not None and self.kv.leases:
                    # idle with kept blocks: wake up to let their leases run out
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), 0.5)
                else:
                    await self._wake.wait()
                next_t = loop.time()
                continue
            # with requests running, the last step ended and this one began at next_t: only
            # requests that arrived by then join it; else the engine is idle and starts now
            on_schedule = bool(self.scheduler.running)
            plan = self.scheduler.schedule(
                partial(self._arrived_by, next_t) if on_schedule else None
            )
            self._start_loads(plan, loop.time())
            if not plan.scheduled:
                self._wake.clear()
                wait = 0.05
                if self._loads:  # nothing to run until a load from the CPU tier is done
                    done = min(ready for ready, _, _ in self._loads.values())
                    wait = min(wait, max(0.0, done - loop.time()))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)
                next_t = loop.time()
                continue
            began = next_t if on_schedule else max(next_t, loop.time())
            for s in plan.scheduled:
                h = self.handles.get(s.request_id)
                if s.new and h is not None and h.admitted_at is None:
                    h.admitted_at = began
                    reported = h.request.cached_tokens_reported
                    # vLLM counts tokens loaded from a peer as cached, unless the peer's hit is
                    # reported instead
                    loaded = s.tier or s.external
                    h.cached_tokens = s.cached_tokens + loaded if reported is None else reported
                    self.metrics.cached_by_source("host", s.tier)
                    self.metrics.queue_time.observe(began - h.arrival)
            dt = self._step_seconds(plan) * self.slowdown / self.config.speed
            self.busy_seconds += dt
            next_t = began + dt
            await asyncio.sleep(max(0.0, next_t - loop.time()))
            if self.hung:
                await self._unhung.wait()  # a hang freezes the step in flight too
                next_t = loop.time()
            result = self.scheduler.complete(plan, self._sample, self._stops)
            self.steps += 1
            self._publish(result.events)
            self._lease(result.kept)
            self._deliver(result.tokens, result.finished)
            self._update_gauges()

    def _publish(self, events: list[KvEvent]) -> None:
        if self.publisher is not None and events:
            self.publisher.publish(events)

    def _start_loads(self, plan: StepPlan, now: float) -> None:
        """Requests that began loading from the CPU tier: when each load will be done."""
        offload = self.scheduler.offload
        for rid, tokens in plan.loads:
            if offload is not None:
                seconds = offload.load_seconds(tokens) * self.slowdown / self.config.speed
                self._loads[rid] = (now + seconds, offload.load_bytes(tokens), seconds)

    def _finish_loads(self, now: float) -> None:
        for rid, (ready, num_bytes, seconds) in list(self._loads.items()):
            if ready <= now:
                del self._loads[rid]
                # vLLM counts a load's bytes and copy time when the copy is done
                self.metrics.offload_loaded(num_bytes, seconds)
                self.scheduler.load_done(rid)

    def _arrived_by(self, t: float, request_id: str) -> bool:
        handle = self.handles.get(request_id)
        return handle is None or handle.arrival <= t

    def _lease(self, kept: list[str]) -> None:
        """Finished prefills whose blocks a decode peer will pull: lease them and name them in
        the request's answer (or free them at once when no lease can be had)."""
        kv = self.kv
        for rid in kept:
            handle = self.handles.get(rid)
            if kv is None or handle is None:
                self.scheduler.release(rid)
                continue
            prompt_len = handle.run_prompt_len
            block_ids = self.cache.block_ids(rid)
            if kv.hold(rid, block_ids, prompt_len):
                handle.kv_transfer_params = kv.params_for(kv.leases[rid], handle.cached_tokens)
            else:
                self.scheduler.release(rid)

    def _apply_control(self) -> None:
        if self.kv is not None:
            self.kv.expire(time.monotonic())
            for rid in self.kv.to_release:
                self.scheduler.release(rid)
            self.kv.to_release.clear()
        for rid in self._aborts:
            handle = self.handles.get(rid)
            self.scheduler.abort(rid)
            if handle is not None:
                self._end(handle, "abort")
        self._aborts.clear()
        if self._reset_requested is not None:
            fut, self._reset_requested = self._reset_requested, None
            ok = self.cache.reset()
            if ok and self.scheduler.offload is not None:
                self.scheduler.offload.reset()  # vLLM resets the connector's tier with it
            self._publish(self.cache.end_step())
            if not fut.done():
                fut.set_result(ok)

    def _step_seconds(self, plan: StepPlan) -> float:
        prefill = prefill_ctx = decodes = decode_ctx = 0
        for s in plan.scheduled:
            sr = self.scheduler.requests.get(s.request_id)
            if sr is None:
                continue
            # tokens pulled from a prefill peer cost no compute here
            start = sr.num_computed - s.num_tokens + s.external
            computed = s.num_tokens - s.external
            if start >= sr.num_prompt and computed == 1:
                decodes += 1
                decode_ctx += start
            else:
                prefill += computed
                prefill_ctx += chunk_context(start, computed)
        return self.config.gpu.step_seconds(prefill, prefill_ctx, decodes, decode_ctx)

    def _sample(self, request_id: str) -> int:
        return self._streams[request_id].next_token()

    def _stops(self, request_id: str, token: int) -> bool:
        handle = self.handles[request_id]
        req = handle.request
        if token == self.tokenizer.eos_token_id and not req.ignore_eos:
            handle.finish_reason = "stop"
            return True
        if token in req.stop_token_ids:
            handle.finish_reason, handle.stop_reason = "stop", token
            return True
        if req.stop:
            text = self.tokenizer.decode([*handle.output_ids, token])
            for stop in req.stop:
                if stop and stop in text:
                    handle.finish_reason, handle.stop_reason = "stop", stop
                    return True
        return False

    def _deliver(self, tokens: dict[str, int], finished: list[str]) -> None:
        now = time.monotonic()
        done = set(finished)
        for rid, token in tokens.items():
            handle = self.handles.get(rid)
            if handle is None:
                continue
            if handle.first_token_at is None:
                handle.first_token_at = now
                self.metrics.ttft.observe(now - handle.arrival)
            elif handle.last_token_at is not None:
                self.metrics.itl.observe(now - handle.last_token_at)
            handle.last_token_at = now
            handle.output_ids.append(token)
            self.metrics.generation_tokens.inc()
            delta = self._text_delta(handle, rid in done)
            if rid in done:
                reason = handle.finish_reason or "length"
                self._end(handle, reason, handle.stop_reason, final=TokenOutput(token, delta))
            else:
                handle.queue.put_nowait(TokenOutput(token, delta))

    def _text_delta(self, handle: RequestHandle, final: bool) -> str:
        text = self.tokenizer.decode(handle.output_ids)
        stop = handle.stop_reason
        if final and isinstance(stop, str) and not handle.request.include_stop_str_in_output:
            text = text[: text.find(stop)] if stop in text else text
        if not final and handle.request.stop:
            # Hold back a tail that could still become a stop string.
            hold = max(len(s) for s in handle.request.stop) - 1
            text = text[: max(len(handle.text), len(text) - hold)]
        delta = text[len(handle.text) :] if text.startswith(handle.text) else ""
        handle.text = text if text.startswith(handle.text) else handle.text
        return delta

    def _end(
        self,
        handle: RequestHandle,
        reason: str,
        stop_reason: str | int | None = None,
        error: str | None = None,
        final: TokenOutput | None = None,
    ) -> None:
        """Finish a request; the last output carries the finish reason (and the last token
        when it finished normally)."""
        rid = handle.request_id
        if self.handles.pop(rid, None) is None:
            return
        self._streams.pop(rid, None)
        if rid in self.scheduler.requests:
            self.scheduler.abort(rid)
        handle.finish_reason = reason
        handle.stop_reason = stop_reason
        if reason in ("stop", "length"):
            self.metrics.finished(reason)
            self.metrics.prompt_tokens.inc(len(handle.request.prompt_ids))
            self.metrics.e2e.observe(time.monotonic() - handle.arrival)
        last = final or TokenOutput(None, "")
        last.finished, last.finish_reason, last.stop_reason, last.error = (
            True, reason, stop_reason, error,
        )  # fmt: skip
        handle.queue.put_nowait(last)

    def _update_gauges(self) -> None:
        m, s = self.metrics, self.scheduler
        m.running.set(s.num_running)
        m.waiting.set(s.num_waiting)
        m.kv_usage.set(self.cache.usage())
        m.prefix_queries.inc(s.prefix_queries - self._reported_queries)
        m.prefix_hits.inc(s.prefix_hits - self._reported_hits)
        m.cached_by_source("device", s.prefix_hits - self._reported_hits)
        m.preemptions.inc(s.num_preemptions - self._reported_preempt)
        self._reported_queries = s.prefix_queries
        self._reported_hits = s.prefix_hits
        self._reported_preempt = s.num_preemptions
