"""Choosing a worker, and saying why.

Every policy prices the eligible workers with the same cost model
(`kvroute.router.routing.cost`: each worker's load and predicted reuse, summed over the
named terms of `kvroute.router.routing.terms`) and returns a `Decision` that keeps every
candidate's picture, term by term, so a decision can always be explained after the fact.

The default policy (`TTFTPolicy`) takes the worker of least cost (the estimated TTFT plus
the junction credit), spills off a saturated best to the best unsaturated worker, and when
nothing of the prompt is cached anywhere follows the session's consistent hash among the
workers about as fast as the fastest. docs/policy.md has the formula and every term.

A policy declares what it needs from the router (`needs_reuse`, `index_view`, `terms`), so
callers ask the policy instead of testing its type; `POLICIES` maps a name to its class.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from typing import ClassVar

from kvroute.router.config import PolicyConfig
from kvroute.router.fleet.workers import Worker
from kvroute.router.routing.cost import LoadModel
from kvroute.router.routing.hashring import HashRing
from kvroute.router.routing.records import Candidate, Decision, RouteInput
from kvroute.router.routing.terms import LOAD_TERMS, ORDER

__all__ = [
    "POLICIES",
    "Candidate",
    "Decision",
    "LoadModel",
    "Policy",
    "RouteInput",
    "make_policy",
    "session_key",
]

# Which reuse a policy reads from the index (`Policy.index_view`)
REACH = "reach"  # hybrid-correct reuse, with full-attention coverage for the junction credit
FULL_ATTENTION_ONLY = "full_attention_only"  # full-attention groups only (llm-d, Dynamo)

# Reasons (stable strings, also metric label values)
CACHE = "cache"  # the least cost, with reuse somewhere in the fleet
SPILL = "spill"  # best was saturated; next best unsaturated taken
AFFINITY = "affinity"  # nothing reusable: where the prompt's full-attention blocks already are
SESSION = "session"  # no cache evidence: consistent hash of the session key
LEAST_LOAD = "least_load"  # no cache evidence and no session key (or policy least_load)
ROUND_ROBIN = "round_robin"
RANDOM = "random"
NO_WORKER = "no_worker"


class Policy:
    """Base: price the candidates, delegate the pick; subclasses implement `pick`.

    What a policy needs from the router is declared here, not inferred from its type:
    `needs_reuse` (it reads predicted reuse: the prompt's prefix sharing is remembered for
    it), `index_view` (which reuse the router scores, `REACH` or `FULL_ATTENTION_ONLY`),
    `terms` (the cost terms it prices, by name, see `kvroute.router.routing.terms`) and
    `decode_in_turn` (a disaggregated request's decode worker is taken in turn, not priced)."""

    name: ClassVar[str] = "base"
    needs_reuse: ClassVar[bool] = False
    index_view: ClassVar[str] = REACH
    terms: ClassVar[tuple[str, ...]] = LOAD_TERMS
    decode_in_turn: ClassVar[bool] = False

    def __init__(self, load_model: LoadModel) -> None:
        self.load_model = load_model
        self._terms = load_model.terms(self.terms)

    def decide(self, workers: Sequence[Worker], req: RouteInput, now: float) -> Decision:
        n = req.n_tokens
        cands = self.load_model.price(workers, req, now, self._terms)
        if not cands:
            return Decision(self.name, None, NO_WORKER, "no eligible worker", [], n, None, 0)
        chosen, reason, detail = self.pick(cands, req)
        return Decision(
            self.name, chosen, reason, detail, cands, n, req.session_key, _cached(chosen)
        )

    def pick(self, cands: list[Candidate], req: RouteInput) -> tuple[Candidate, str, str]:
        raise NotImplementedError

    def forget_worker(self, name: str) -> None:
        """A worker left the fleet: drop whatever the policy keeps about it (default: none)."""


def _cached(c: Candidate) -> int:
    """Prompt tokens the candidate need not prefill: GPU reuse plus lower-tier loads."""
    return (c.reuse or 0) + c.cpu_tokens + c.storage_tokens


def _tier_note(c: Candidate) -> str:
    """The lower-tier part of a decision's text (empty without one)."""
    if not (c.cpu_tokens or c.storage_tokens):
        return ""
    return f", loading {c.cpu_tokens} from CPU and {c.storage_tokens} from storage"


class _Rotation:
    """A counter that spreads ties and cold requests across equal workers."""

    def __init__(self) -> None:
        self.n = 0

    def next(self) -> int:
        self.n += 1
        return self.n


def least_load(cands: list[Candidate], rotation: _Rotation) -> Candidate:
    """Least queued prefill, then fewest running; equal workers take turns."""
    turn = rotation.next()
    size = len(cands)
    best = cands[0]
    best_key = (best.queued_tokens, best.running, turn % size)
    for i in range(1, size):
        c = cands[i]
        key = (c.queued_tokens, c.running, (turn + size - i) % size)
        if key < best_key:
            best, best_key = c, key
    return best


class SessionPicker:
    """Consistent hashing with bounded load over the candidates, keyed by session."""

    def __init__(self, cfg: PolicyConfig) -> None:
        self._ring = HashRing(cfg.virtual_nodes)
        self._bound = cfg.session_bounded_load

    def pick(self, cands: list[Candidate], key: str) -> Candidate | None:
        by_name = {c.name: c for c in cands}
        for name in by_name:
            self._ring.add(name)  # idempotent; the ring keeps every worker ever seen
        unsaturated = {n for n, c in by_name.items() if not c.saturated} or set(by_name)
        load = {n: c.running for n, c in by_name.items()}
        found = self._ring.lookup(key, unsaturated.__contains__, load, self._bound)
        return by_name.get(found) if found is not None else None

    def forget(self, name: str) -> None:
        self._ring.remove(name)


class TTFTPolicy(Policy):
    """Default: least cost (estimated TTFT plus the junction credit), exact ties by the
    session's hash or in turn; spill off a saturated best; with no cache evidence anywhere,
    the session's hash among the near-fastest, else least load."""

    name = "ttft"
    needs_reuse = True
    terms = ORDER

    def __init__(self, load_model: LoadModel, cfg: PolicyConfig) -> None:
        super().__init__(load_model)
        self.cfg = cfg
        self.session = SessionPicker(cfg)
        self.rotation = _Rotation()

    def forget_worker(self, name: str) -> None:
        self.session.forget(name)

    def pick(self, cands: list[Candidate], req: RouteInput) -> tuple[Candidate, str, str]:
        best_reuse = max((c.reuse or 0 for c in cands), default=0)
        # lower tiers count as evidence: a prompt held only in CPU memory is not cold
        best_cached = best_reuse
        if req.tiers:  # without tiers no candidate loads anything from one
            best_cached = max(best_reuse, max((_cached(c) for c in cands), default=0))
        if best_cached <= 0 and not any(c.affinity for c in cands):
            return self._cold(cands, req)

        def key(c: Candidate) -> tuple[float, int, int]:
            return (c.cost_s, -(c.reuse or 0), c.running)

        best = self._spread_ties(_tied(cands, key), req)
        if best.saturated and self.cfg.spill:
            calm = [c for c in cands if not c.saturated]
            if calm:
                alt = self._spread_ties(_tied(calm, key), req)
                return (
                    alt,
                    SPILL,
                    f"{best.name} saturated (est TTFT {best.est_ttft_s:.3f}s, running "
                    f"{best.running}); best unsaturated reuses {alt.reuse or 0} tokens",
                )
        if best.affinity > 0 and (best.reuse or 0) < max(best_reuse, 1):
            return (
                best,
                AFFINITY,
                f"reuses {best.reuse or 0} of {req.n_tokens} tokens (fleet best {best_reuse}) "
                f"but its full-attention blocks hold {best.affinity} more: serving it there "
                "stores the state that later requests sharing them reuse",
            )
        if best_cached <= 0:
            return best, LEAST_LOAD, "nothing reusable; lowest estimated TTFT"
        return (
            best,
            CACHE,
            f"lowest est TTFT {best.est_ttft_s:.3f}s reusing {best.reuse or 0} of "
            f"{req.n_tokens} tokens{_tier_note(best)} (fleet best reuse {best_reuse})",
        )

    def _spread_ties(self, tied: list[Candidate], req: RouteInput) -> Candidate:
        """One of candidates equal in cost, reuse and running: by the session's hash, else in
        turn, as a cold request goes; a fixed order would send every such tie (a prompt whose
        only cached part is a prefix every worker holds) to the same worker."""
        if len(tied) == 1:
            return tied[0]
        return self._by_session_or_turn(tied, tied, req.session_key)[0]

    def _by_session_or_turn(
        self, keyed: list[Candidate], anyone: list[Candidate], session_key: str | None
    ) -> tuple[Candidate, bool]:
        """The session's hash among `keyed` (True), else `anyone` in turn (False)."""
        if session_key is not None:
            chosen = self.session.pick(keyed, session_key)
            if chosen is not None:
                return chosen, True
        return least_load(anyone, self.rotation), False

    def _cold(self, cands: list[Candidate], req: RouteInput) -> tuple[Candidate, str, str]:
        calm = [c for c in cands if not c.saturated] or cands
        slack = self.cfg.session_slack_tokens * self.load_model.seconds_per_token()
        if req.placement is not None:
            calm = _least_displacing(calm, slack)
        near = calm
        if req.session_key is not None:
            # The hash keeps replicas agreeing and a fleet without events sticky, but only
            # among the workers about as fast as the fastest: nothing here is cached, so
            # waiting behind another prompt's prefill buys nothing.
            limit = min(c.est_ttft_s for c in calm) + slack
            near = [c for c in calm if c.est_ttft_s <= limit]
        chosen, keyed = self._by_session_or_turn(near, calm, req.session_key)
        if keyed:
            return chosen, SESSION, "no cache evidence; session affinity (bounded load)"
        return chosen, LEAST_LOAD, "no cache evidence and no session key; least load"


def _tied(
    cands: list[Candidate], key: Callable[[Candidate], tuple[float, int, int]]
) -> list[Candidate]:
    """The candidates that share the least `key`, in name order (so replicas whose
    registries list the workers in different orders see them alike): the least cost is
    found at C speed and only the candidates tied on it build the full key (costs are never
    NaN)."""
    least = min(map(_COST, cands))
    on_cost = [c for c in cands if c.cost_s == least]
    if len(on_cost) == 1:  # the usual case: no key to build, nothing to sort
        return on_cost
    keyed = [(key(c), c) for c in on_cost]
    top = min(k for k, _ in keyed)
    return sorted((c for k, c in keyed if k == top), key=_NAME)


_COST = attrgetter("cost_s")
_NAME = attrgetter("name")


def _least_displacing(cands: list[Candidate], slack_s: float) -> list[Candidate]:
    """The candidates whose `placement` term is within `slack_s` of the least: a new
    conversation goes where it pushes the least expected history out of a pool (all of
    them when the term pushes nothing out anywhere)."""
    cost = [c.terms.get("placement", 0.0) for c in cands]
    least = min(cost)
    if max(cost) <= least:
        return cands
    return [c for c, v in zip(cands, cost, strict=True) if v <= least + slack_s]


class FullAttentionOnlyPolicy(TTFTPolicy):
    """TTFT policy fed with full-attention-only reuse (what llm-d and Dynamo index).

    Identical decision rule; the app computes `RouteInput.reuse` from the full-attention
    groups only, so benchmark comparisons isolate the effect of hybrid-correct scoring.
    (Its reuse already is the coverage, so the affinity step never applies.)
    """

    name = "full_attention_only"
    index_view = FULL_ATTENTION_ONLY


class RoundRobinPolicy(Policy):
    name = "round_robin"
    decode_in_turn = True  # both halves of a P/D request in turn: the cache-blind baseline

    def __init__(self, load_model: LoadModel) -> None:
        super().__init__(load_model)
        self.rotation = _Rotation()

    def pick(self, cands: list[Candidate], req: RouteInput) -> tuple[Candidate, str, str]:
        ordered = sorted(cands, key=lambda c: c.name)
        return ordered[self.rotation.next() % len(ordered)], ROUND_ROBIN, "round robin"


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, load_model: LoadModel, seed: int | None) -> None:
        super().__init__(load_model)
        self.rng = random.Random(seed)

    def pick(self, cands: list[Candidate], req: RouteInput) -> tuple[Candidate, str, str]:
        return self.rng.choice(cands), RANDOM, "uniformly random"


class LeastLoadPolicy(Policy):
    name = "least_load"

    def __init__(self, load_model: LoadModel) -> None:
        super().__init__(load_model)
        self.rotation = _Rotation()

    def pick(self, cands: list[Candidate], req: RouteInput) -> tuple[Candidate, str, str]:
        return least_load(cands, self.rotation), LEAST_LOAD, "least load (cache ignored)"


class SessionPolicy(Policy):
    name = "session"

    def __init__(self, load_model: LoadModel, cfg: PolicyConfig) -> None:
        super().__init__(load_model)
        self.session = SessionPicker(cfg)
        self.rotation = _Rotation()

    def forget_worker(self, name: str) -> None:
        self.session.forget(name)

    def pick(self, cands: list[Candidate], req: RouteInput) -> tuple[Candidate, str, str]:
        if req.session_key is not None:
            chosen = self.session.pick(cands, req.session_key)
            if chosen is not None:
                return chosen, SESSION, "session affinity (bounded load)"
        return least_load(cands, self.rotation), LEAST_LOAD, "no session key; least load"


POLICIES: dict[str, Callable[[PolicyConfig, LoadModel], Policy]] = {
    TTFTPolicy.name: lambda cfg, lm: TTFTPolicy(lm, cfg),
    FullAttentionOnlyPolicy.name: lambda cfg, lm: FullAttentionOnlyPolicy(lm, cfg),
    RoundRobinPolicy.name: lambda cfg, lm: RoundRobinPolicy(lm),
    RandomPolicy.name: lambda cfg, lm: RandomPolicy(lm, cfg.seed),
    LeastLoadPolicy.name: lambda cfg, lm: LeastLoadPolicy(lm),
    SessionPolicy.name: lambda cfg, lm: SessionPolicy(lm, cfg),
}


def make_policy(cfg: PolicyConfig, load_model: LoadModel) -> Policy:
    """The configured policy (names validated by the config; `POLICIES` lists them)."""
    build = POLICIES.get(cfg.name)
    if build is None:
        raise ValueError(f"unknown policy {cfg.name!r}")
    return build(cfg, load_model)


def session_key(
    headers: Mapping[str, str], body: Mapping[str, object], cfg: PolicyConfig
) -> str | None:
    """The request's session key: the configured header, else the configured body field.

    The field may be dotted ("metadata.session_id"). Empty values count as absent.
    """
    value = headers.get(cfg.session_header.lower()) if cfg.session_header else None
    if value:
        return value
    if not cfg.session_field:
        return None
    node: object = body
    for part in cfg.session_field.split("."):
        if not isinstance(node, Mapping):
            return None
        node = node.get(part)
    if isinstance(node, str) and node:
        return node
    if isinstance(node, int) and not isinstance(node, bool):
        return str(node)
    return None
