"""Continuous batching as vLLM's V1 scheduler does it, without a clock.

Each step: running requests first (decode 1 token, or the next prefill chunk), preempting the
newest running request when blocks run out; then waiting requests in FCFS order while there
are free slots (max_num_seqs) and token budget (max_num_scheduled_tokens), each admitted with
its prefix-cache hit. Prefill is chunked by the budget (and by the Mamba aligned split).
`complete()` then applies the step's results: sampled tokens, stops, frees, and returns the
step's KV events. Time is added by the engine (kvroute.sim.engine.core) from the returned plan.

With a CPU tier (`kvroute.sim.offload`), a waiting request whose prompt continues in the tier
beyond its GPU hit leaves the queue to load it (`StepPlan.loads`, vLLM's
WAITING_FOR_REMOTE_KVS); when the engine says the load is done (`load_done`) it goes back to
the front of the queue and is admitted with the loaded tokens as computed. Every step offers
the tier the chunks the scheduled requests filled, and a batch's CPU events follow its GPU
events.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvroute.sim.cache_api import CacheBackend, CacheRequest
from kvroute.sim.events import KvEvent
from kvroute.sim.offload import OffloadConnector


@dataclass(slots=True)
class SchedRequest:
    """Scheduler-side view of one request."""

    req: CacheRequest
    num_tokens: int
    num_computed: int = 0
    num_output: int = 0
    hit_tokens: int | None = None  # prefix-cache hit at first admission
    preemptions: int = 0
    finished: bool = False
    # prompt tokens up to here arrive from a prefill peer (a KV connector's external tokens);
    # they are taken on admission without compute, once
    external_end: int = 0
    tier_checked: bool = False  # the CPU tier was looked up since the last (re)admission
    tier_end: int = 0  # GPU hit + tokens loaded from the CPU tier (what vLLM reports cached)

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def num_prompt(self) -> int:
        return len(self.req.prompt_token_ids)


@dataclass(slots=True)
class Scheduled:
    """One request's share of a step."""

    request_id: str
    num_tokens: int  # tokens computed this step
    new: bool  # admitted this step
    cached_tokens: int  # prefix-cache hit adopted on admission (0 otherwise)
    external: int = 0  # of num_tokens, loaded from a prefill peer rather than computed
    tier: int = 0  # prompt tokens loaded from the CPU tier (reported cached with the GPU hit)


@dataclass(slots=True)
class StepPlan:
    """What a step computes, and who was preempted for it."""

    scheduled: list[Scheduled] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    loads: list[tuple[str, int]] = field(default_factory=list)  # (request, tokens) from CPU

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass(slots=True)
class StepResult:
    """What a step produced: sampled tokens, finished requests, KV events."""

    tokens: dict[str, int] = field(default_factory=dict)  # request id -> sampled token
    finished: list[str] = field(default_factory=list)
    events: list[KvEvent] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # finished, blocks kept for a peer


# (request id, token) -> whether the request stops after this token
StopCheck = Callable[[str, int], bool]
Sampler = Callable[[str], int]


class Scheduler:
    """vLLM's V1 scheduling over a `CacheBackend` (see the module docstring)."""

    def __init__(
        self,
        cache: CacheBackend,
        *,
        max_num_seqs: int = 256,
        max_num_scheduled_tokens: int = 2048,
        offload: OffloadConnector | None = None,
    ) -> None:
        self.cache = cache
        self.offload = offload
        self.loading: dict[str, int] = {}  # request -> tokens being loaded from the CPU tier
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_scheduled_tokens
        self.requests: dict[str, SchedRequest] = {}
        self.waiting: deque[str] = deque()
        self.running: list[str] = []
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_preemptions = 0
        # requests whose blocks outlive them (a prefill kept for a decode peer): the engine
        # frees them with `release`
        self.keep: set[str] = set()

    # ---- queue -----------------------------------------------------------------------
    def add(self, req: CacheRequest, external_end: int = 0, keep: bool = False) -> None:
        """Queue a request (FCFS). `external_end`: its prompt up to there comes from a
        prefill peer; `keep`: its blocks are kept when it finishes (see `release`)."""
        self.cache.add_request(req)
        sr = SchedRequest(req, len(req.prompt_token_ids), external_end=external_end)
        self.requests[req.request_id] = sr
        self.waiting.append(req.request_id)
        if keep:
            self.keep.add(req.request_id)

    def release(self, request_id: str) -> None:
        """Free the blocks of a finished request that `add(keep=True)` kept."""
        self.cache.free(request_id)

    def abort(self, request_id: str) -> None:
        """Drop a request now (client went away); its blocks return to the pool."""
        sr = self.requests.pop(request_id, None)
        self.keep.discard(request_id)
        if sr is None:
            return
        if request_id in self.running:
            self.running.remove(request_id)
        elif request_id in self.waiting:
            self.waiting.remove(request_id)
        self.loading.pop(request_id, None)
        if self.offload is not None:
            # vLLM stores an aborted request's chunks up to what it computed
            self.offload.finish(request_id, sr.num_computed)
        self.cache.free(request_id)

    def load_done(self, request_id: str) -> None:
        """The request's load from the CPU tier finished: back to the front of the queue."""
        if self.loading.pop(request_id, None) is None:
            return
        if self.offload is not None:
            self.offload.load_done(request_id)
        self.waiting.appendleft(request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        """Whether any request is running, waiting or loading from the CPU tier."""
        return bool(self.running or self.waiting or self.loading)

    def flush_offload(self) -> list[KvEvent]:
        """The CPU tier's pending store events (for an engine going idle)."""
        return self.offload.flush() if self.offload is not None else []

    # ---- one step --------------------------------------------------------------------
    def schedule(self, admissible: Callable[[str], bool] | None = None) -> StepPlan:
        """Plan one step: running requests first, then admissions (see the module docstring).
        `admissible`: whether a waiting request may join this step (the engine passes "it
        arrived before the step began"); admission stops at the first that may not (FCFS)."""
        plan = StepPlan()
        budget = self.budget
        self.cache.begin_step()
        idx = 0
        while idx < len(self.running) and budget > 0:
            rid = self.running[idx]
            sr = self.requests[rid]
            n = min(sr.num_tokens - sr.num_computed, budget)
            n = self.cache.split_chunk(rid, n, 0)
            if n <= 0:
                idx += 1
                continue
            scheduled = False
            while True:
                if self.cache.allocate(rid, n):
                    scheduled = True
                    break
                victim = self.running.pop()  # preempt the newest running request
                self._preempt(victim, plan)
                if victim == rid:
                    break
            if not scheduled:
                break
            plan.scheduled.append(Scheduled(rid, n, new=False, cached_tokens=0))
            budget -= n
            idx += 1
        if not plan.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                rid = self.waiting[0]
                if admissible is not None and not admissible(rid):
                    break
                sr = self.requests[rid]
                lookup = self.cache.lookup(rid)
                if self._load_from_tier(rid, sr, lookup.hit_tokens, plan):
                    continue
                # the last prompt token is always computed (its logits give the first token)
                ext_end = min(sr.external_end, sr.num_tokens - 1)
                ext = max(0, ext_end - lookup.hit_tokens)
                n = ext + min(sr.num_tokens - lookup.hit_tokens - ext, budget)
                n = self.cache.split_chunk(rid, n, lookup.hit_tokens)
                if n <= 0 or not self.cache.allocate(rid, n, lookup):
                    break
                ext = min(ext, n)
                sr.external_end = 0  # loaded once; a preempted request recomputes
                self.waiting.popleft()
                self.running.append(rid)
                self.prefix_queries += sr.num_tokens
                self.prefix_hits += lookup.hit_tokens
                if sr.hit_tokens is None:
                    sr.hit_tokens = lookup.hit_tokens
                sr.num_computed = lookup.hit_tokens
                tier = max(0, sr.tier_end - lookup.hit_tokens)
                sr.tier_end = 0
                plan.scheduled.append(
                    Scheduled(
                        rid, n, new=True, cached_tokens=lookup.hit_tokens, external=ext, tier=tier
                    )
                )
                budget -= n - ext
        # Scheduled chunks now count as computed (vLLM's _update_after_schedule).
        for s in plan.scheduled:
            sr = self.requests[s.request_id]
            sr.num_computed += s.num_tokens
            self.cache.advance(s.request_id, s.num_tokens)
            if self.offload is not None:
                self.offload.offer(s.request_id, sr.num_computed)
        self.cache.end_schedule()
        return plan

    def _load_from_tier(self, rid: str, sr: SchedRequest, gpu_hit: int, plan: StepPlan) -> bool:
        """On admission: if the CPU tier continues the prompt, start loading it instead."""
        if self.offload is None or sr.tier_checked or sr.external_end:
            return False
        sr.tier_checked = True
        tokens = self.offload.lookup(rid, gpu_hit, sr.num_tokens)
        if not tokens:
            return False
        self.waiting.popleft()
        sr.external_end = sr.tier_end = gpu_hit + tokens
        self.loading[rid] = tokens
        plan.loads.append((rid, tokens))
        return True

    def _preempt(self, rid: str, plan: StepPlan) -> None:
        sr = self.requests[rid]
        self.cache.preempt(rid)
        sr.num_computed = 0
        sr.tier_checked = False  # looked up again on readmission, as vLLM does
        sr.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(rid)
        plan.preempted.append(rid)
        # A preempted request may already be in this step's plan: take it out.
        plan.scheduled = [s for s in plan.scheduled if s.request_id != rid]

    def complete(self, plan: StepPlan, sample: Sampler, stops: StopCheck) -> StepResult:
        """Apply a step: requests whose prompt is fully computed sample one token."""
        result = StepResult()
        for s in plan.scheduled:
            sr = self.requests.get(s.request_id)
            if sr is None or sr.num_computed < sr.num_tokens:
                continue  # aborted meanwhile, or still prefilling
            token = sample(s.request_id)
            self.cache.append_token(s.request_id, token)
            sr.num_tokens += 1
            sr.num_output += 1
            result.tokens[s.request_id] = token
            if (
                stops(s.request_id, token)  # EOS / stop tokens / stop strings first, as vLLM
                or sr.num_output >= sr.req.max_tokens
                or sr.num_tokens >= self.cache.spec.max_model_len
            ):
                sr.finished = True
                result.finished.append(s.request_id)
        for rid in result.finished:
            self.running.remove(rid)
            sr = self.requests.pop(rid)
            if self.offload is not None:
                # the last sampled token has no KV yet (vLLM's commit point)
                self.offload.finish(rid, max(sr.num_prompt, sr.num_tokens - 1))
            if rid in self.keep:
                self.keep.discard(rid)
                result.kept.append(rid)
            else:
                self.cache.free(rid)
        result.events = self.cache.end_step()
        if self.offload is not None:
            result.events += self.offload.end_step()
        return result
