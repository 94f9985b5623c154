"""What a policy sees and decides: `RouteInput` (one request), `Candidate` (one worker as the
policy priced it) and `Decision` (the choice, why, and every candidate's picture)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvroute.router.fleet.workers import Worker
from kvroute.router.routing.index_view import TierReuse
from kvroute.router.routing.working_set import Conversation, WorkingSet


@dataclass(slots=True)
class Candidate:
    """One eligible worker as the policy saw it."""

    worker: Worker
    reuse: int | None  # predicted reusable prompt tokens (None = no evidence)
    uncached: int  # prompt tokens to prefill
    running: int  # requests on the worker (own + other replicas')
    queued_tokens: int  # prefill tokens ahead of this request
    kv_usage: float | None
    # the estimated TTFT: the sum of the time terms (`kvroute.router.routing.terms`)
    est_ttft_s: float
    saturated: bool
    # full-attention prompt tokens a junction saved here would make reusable beyond the
    # fleet's best reuse (`kvroute.router.routing.terms.junction`)
    affinity: int = 0
    # prompt tokens beyond `reuse` the worker loads from its CPU / storage tier (not in
    # `uncached`; priced by `kvroute.router.routing.terms.tier_load`)
    cpu_tokens: int = 0
    storage_tokens: int = 0
    # what the policy ranks by: est_ttft_s plus the credits (the junction credit)
    cost_s: float = 0.0
    # the priced terms' names (shared by a decision's candidates) and values in seconds,
    # in the order they are summed
    term_names: tuple[str, ...] = ()
    term_values: tuple[float, ...] = ()

    @property
    def name(self) -> str:
        return self.worker.name

    @property
    def predicted_cached(self) -> int | None:
        """What the engine should report as cached: the GPU reuse plus the tokens loaded from
        lower tiers (vLLM counts both); None without evidence."""
        if self.reuse is None:
            return None
        return self.reuse + self.cpu_tokens + self.storage_tokens

    @property
    def terms(self) -> dict[str, float]:
        """Every priced term's value in seconds, by name (built when asked for)."""
        return dict(zip(self.term_names, self.term_values, strict=True))


@dataclass(slots=True)
class Decision:
    policy: str
    chosen: Candidate | None
    reason: str
    detail: str
    candidates: list[Candidate]
    n_tokens: int
    session_key: str | None
    predicted_reuse: int  # reuse of the chosen worker (0 when unknown)


@dataclass(frozen=True, slots=True)
class RouteInput:
    """What a policy needs from one request."""

    n_tokens: int  # prompt length (estimated when ids are unknown)
    reuse: Mapping[str, int | None]  # predicted reuse per worker (empty = no ids)
    session_key: str | None
    # full-attention coverage of the workers with sliding-window or Mamba groups (missing:
    # the same as the reuse); see `kvroute.router.routing.terms.junction`
    coverage: Mapping[str, int] | None = None
    # where the prompt becomes its conversation's own history
    # (`kvroute.router.routing.prefix_sharing`; None: nothing of it known to be its own)
    own_from: int | None = None
    # per worker, the tokens its lower tiers add beyond its reuse (absent: none); see
    # `kvroute.router.routing.terms.tier_load`
    tiers: Mapping[str, TierReuse] | None = None
    # the working set and pools, when the placement term is on (None: off)
    placement: PlacementInput | None = None


@dataclass(frozen=True, slots=True)
class PlacementInput:
    """What the placement term reads (`kvroute.router.routing.terms.placement`): the
    working set, the conversation this request continues (None: a new one), each worker's
    pool in tokens (absent: unknown) and the time."""

    working_set: WorkingSet
    own: Conversation | None
    capacity: Mapping[str, int]
    now: float
