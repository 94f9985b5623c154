"""Choosing a worker, and saying why.

Every policy sees the same per-candidate picture (`Candidate`: predicted reuse, uncached
prefill, load, estimated time to first token, saturation) and returns a `Decision` that keeps
that picture, so a decision can always be explained after the fact.

Estimated TTFT of a request on worker w (seconds):
    (queue_weight * queued_prefill(w) + uncached(w) + tokens_per_running * running(w))
        / prefill_rate
        + step_wait_weight * step_wait(w)
(tokens_per_running_home instead on the request's home: the one worker whose reuse beats
every other's by at least a hash unit, see `home_worker`, unless it runs more than
`policy.home_load_bound` times the fleet's mean)
where prefill_rate is `policy.prefill_tokens_per_s` (or, with `policy.learn_prefill_rate`, the
rate measured from streamed first bytes), queued_prefill counts this process's in-flight
prefill tokens plus the engine's other waiting requests at the learned mean size, and
uncached(w) = prompt tokens - reuse(w) (queue_weight applies only where reuse(w) > 0: where
nothing of the prompt is cached the queue is waited in full), and step_wait(w) is the
expected wait for the engine step in flight on a busy worker (`kvroute.router.fleet.step_clock`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvroute.router.config import PolicyConfig
from kvroute.router.fleet.workers import Worker
from kvroute.router.routing.hashring import HashRing

# Reasons (stable strings, also metric label values)
CACHE = "cache"  # the best estimated TTFT, with reuse somewhere in the fleet
SPILL = "spill"  # best was saturated; next best unsaturated taken
AFFINITY = "affinity"  # nothing reusable: where the prompt's full-attention blocks already are
SESSION = "session"  # no cache evidence: consistent hash of the session key
LEAST_LOAD = "least_load"  # no cache evidence and no session key (or policy least_load)
ROUND_ROBIN = "round_robin"
RANDOM = "random"
NO_WORKER = "no_worker"


@dataclass(slots=True)
class Candidate:
    """One eligible worker as the policy saw it."""

    worker: Worker
    reuse: int | None  # predicted reusable prompt tokens (None = no evidence)
    uncached: int  # prompt tokens to prefill
    running: int  # requests on the worker (own + other replicas')
    queued_tokens: int  # prefill tokens ahead of this request
    kv_usage: float | None
    est_ttft_s: float
    saturated: bool
    # full-attention prompt tokens a junction saved here would make reusable beyond the
    # fleet's best reuse (TTFTPolicy._junction_credit)
    affinity: int = 0
    step_wait_s: float = 0.0  # expected wait for the worker's step in flight (in est_ttft_s)

    @property
    def name(self) -> str:
        return self.worker.name


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
    # the same as the reuse); see TTFTPolicy._junction_credit
    coverage: Mapping[str, int] | None = None
    # where the prompt becomes its conversation's own history
    # (`kvroute.router.routing.prefix_sharing`;
    # None: nothing of it known to be its own)
    own_from: int | None = None


class LoadModel:
    """Turns a worker's load and a request's uncached tokens into an estimated TTFT."""

    def __init__(
        self,
        cfg: PolicyConfig,
        mean_prompt: Callable[[], float],
        stale_after_s: float,
        prefill_rate: Callable[[], float] | None = None,
    ) -> None:
        self.cfg = cfg
        self._mean_prompt = mean_prompt
        self._stale = stale_after_s
        # learned from first bytes (kvroute.router.fleet.load.PrefillRateEstimate), else the
        # configured one
        self._rate = prefill_rate or (lambda: cfg.prefill_tokens_per_s)

    def seconds_per_token(self) -> float:
        """Prefill seconds per uncached token, as the estimates use it now."""
        return 1.0 / self._rate()

    def candidate(self, worker: Worker, reuse: int | None, n_tokens: int, now: float) -> Candidate:
        return self.candidates([worker], {worker.name: reuse}, n_tokens, now)[0]

    def candidates(
        self, workers: Sequence[Worker], reuse: Mapping[str, int | None], n_tokens: int, now: float
    ) -> list[Candidate]:
        """One Candidate per worker (a tight loop: this runs for every worker per request)."""
        cfg = self.cfg
        inv_rate = self.seconds_per_token()
        # in prefill tokens, so the fleet's true rate keeps the ranking (see PolicyConfig)
        per_running = cfg.tokens_per_running * inv_rate
        home = home_worker(reuse, cfg.hash_unit)
        per_running_home = cfg.tokens_per_running_home * inv_rate
        queue_weight = cfg.queue_weight
        # Below-1 queue weight keeps a request with its cache; without reuse there it is waited
        # in full (two cold re-prefills would otherwise stack on one busy worker)
        cold_weight = 1.0 if cfg.full_queue_without_reuse else queue_weight
        step_weight = cfg.step_wait_weight
        sat_queue = cfg.saturation_queue_s
        max_running = cfg.max_running_per_worker
        kv_sat = cfg.kv_usage_saturation
        stale = self._stale
        mean_prompt = self._mean_prompt()
        get = reuse.get
        out: list[Candidate] = []
        append = out.append
        for worker in workers:
            load = worker.load
            queued = load.queued_prefill_tokens
            running = load.running
            kv = None
            m = load.engine
            if m is not None and now - m.at <= stale:
                others_total, others_waiting = load.others(now, stale)
                queued += round(others_waiting * mean_prompt)
                running += others_total
                kv = m.kv_usage
            r = get(worker.name)
            if r is None:
                uncached = n_tokens
            elif r >= n_tokens:
                uncached = 0
            else:
                uncached = n_tokens - r
            queue_s = queued * inv_rate
            step_wait = load.steps.expected_wait(now, running > 0) if step_weight else 0.0
            est = (
                (queue_weight if r else cold_weight) * queue_s
                + uncached * inv_rate
                + (per_running_home if worker.name == home else per_running) * running
                + step_weight * step_wait
            )
            saturated = (
                queue_s > sat_queue or running >= max_running or (kv is not None and kv >= kv_sat)
            )
            append(
                Candidate(
                    worker, r, uncached, running, queued, kv, est, saturated, step_wait_s=step_wait
                )
            )
        if home is not None and cfg.home_load_bound > 0:
            _charge_a_crowded_home(out, home, cfg.home_load_bound, per_running - per_running_home)
        return out


def _charge_a_crowded_home(cands: list[Candidate], home: str, bound: float, extra: float) -> None:
    """Take back the home's per-running discount where the home runs more than `bound` times
    the fleet's mean: a prefix only one worker holds (a tenant's system prompt) otherwise
    draws every new conversation there, and their prefills evict the state of the ones
    already there."""
    mean = sum(c.running for c in cands) / len(cands)
    for c in cands:
        if c.name == home and c.running > bound * mean:
            c.est_ttft_s += extra * c.running


def home_worker(reuse: Mapping[str, int | None], margin: int) -> str | None:
    """The worker whose predicted reuse exceeds every other's by at least `margin` tokens
    (where the request's own conversation is cached, beyond what the fleet shares, such as a
    system prompt), or None when the best is shared or there is no evidence."""
    best_name: str | None = None
    best = second = 0
    for name, r in reuse.items():
        if r is None:
            continue
        if best_name is None or r > best:
            best_name, best, second = name, r, best
        elif r > second:
            second = r
    if best_name is None or best - second < max(margin, 1):
        return None
    return best_name


class Policy:
    """Base: build candidates, delegate the pick; subclasses implement `pick`."""

    name = "base"

    def __init__(self, load_model: LoadModel) -> None:
        self.load_model = load_model

    def decide(self, workers: Sequence[Worker], req: RouteInput, now: float) -> Decision:
        n = req.n_tokens
        reuse = req.reuse
        cands = self.load_model.candidates(workers, reuse, n, now)
        if not cands:
            return Decision(self.name, None, NO_WORKER, "no eligible worker", [], n, None, 0)
        chosen, reason, detail = self.pick(cands, req)
        return Decision(
            self.name, chosen, reason, detail, cands, n, req.session_key, chosen.reuse or 0
        )

    def pick(self, cands: list[Candidate], req: RouteInput) -> tuple[Candidate, str, str]:
        raise NotImplementedError


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
    """Default: minimise estimated TTFT; spill off saturated workers; cold: session, load."""

    name = "ttft"

    def __init__(self, load_model: LoadModel, cfg: PolicyConfig) -> None:
        super().__init__(load_model)
        self.cfg = cfg
        self.session = SessionPicker(cfg)
        self.rotation = _Rotation()

    def pick(self, cands: list[Candidate], req: RouteInput) -> tuple[Candidate, str, str]:
        best_reuse = max((c.reuse or 0 for c in cands), default=0)
        credit = self._junction_credit(cands, req, best_reuse)
        if best_reuse <= 0 and not any(c.affinity for c in cands):
            return self._cold(cands, req)

        def key(c: Candidate) -> tuple[float, int, int, str]:
            # The name breaks exact ties, so replicas whose registries list the workers in
            # different orders (discovery events arrive in any order) choose alike.
            return (c.est_ttft_s - credit * c.affinity, -(c.reuse or 0), c.running, c.name)

        best = min(cands, key=key)
        if best.saturated and self.cfg.spill:
            calm = [c for c in cands if not c.saturated]
            if calm:
                alt = min(calm, key=key)
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
        if best_reuse <= 0:
            return best, LEAST_LOAD, "nothing reusable; lowest estimated TTFT"
        return (
            best,
            CACHE,
            f"lowest est TTFT {best.est_ttft_s:.3f}s reusing {best.reuse or 0} of "
            f"{req.n_tokens} tokens (fleet best reuse {best_reuse})",
        )

    def _cold(self, cands: list[Candidate], req: RouteInput) -> tuple[Candidate, str, str]:
        calm = [c for c in cands if not c.saturated] or cands
        if req.session_key is not None:
            # The hash keeps replicas agreeing and a fleet without events sticky, but only
            # among the workers about as fast as the fastest: nothing here is cached, so
            # waiting behind another prompt's prefill buys nothing.
            slack = self.cfg.session_slack_tokens * self.load_model.seconds_per_token()
            limit = min(c.est_ttft_s for c in calm) + slack
            near = [c for c in calm if c.est_ttft_s <= limit]
            chosen = self.session.pick(near, req.session_key)
            if chosen is not None:
                return chosen, SESSION, "no cache evidence; session affinity (bounded load)"
        chosen = least_load(calm, self.rotation)
        return chosen, LEAST_LOAD, "no cache evidence and no session key; least load"

    def _junction_credit(self, cands: list[Candidate], req: RouteInput, best_reuse: int) -> float:
        """Seconds credited per full-attention token a worker holds beyond its reuse.

        On hybrid models vLLM keeps sliding-window and Mamba state only at replay boundaries
        and shared-prefix junctions: a prefix that a worker's full-attention blocks hold
        becomes reusable there once a request sharing it is served there (vLLM saves the
        state at the junction). Greedy "most reuse now" never makes that investment, so
        the next requests sharing the prefix keep paying for it; `affinity_weight` is the
        fraction of those tokens' prefill time credited. With `junction_shared_only` only
        the tokens before the conversation's own history (`RouteInput.own_from`) beyond the
        fleet's best reuse count. Sets `Candidate.affinity`."""
        weight = self.cfg.affinity_weight
        coverage = req.coverage
        if not coverage or weight <= 0:
            return 0.0
        limit = req.n_tokens
        floor = 0
        if self.cfg.junction_shared_only:
            # Worth it only where other conversations will branch off (see
            # kvroute.router.routing.prefix_sharing) and beyond what a worker reuses already: a
            # junction
            # below the fleet's best reuse is a second copy, which the load terms price.
            if req.own_from is not None:
                limit = min(limit, req.own_from)
            floor = best_reuse
        for c in cands:
            covered = coverage.get(c.name)
            if covered:
                c.affinity = max(0, min(covered, limit) - max(c.reuse or 0, floor))
        return weight * self.load_model.seconds_per_token()


class FullAttentionOnlyPolicy(TTFTPolicy):
    """TTFT policy fed with full-attention-only reuse (what llm-d and Dynamo index).

    Identical decision rule; the app computes `RouteInput.reuse` from the full-attention
    groups only, so benchmark comparisons isolate the effect of hybrid-correct scoring.
    (Its reuse already is the coverage, so the affinity step never applies.)
    """

    name = "full_attention_only"


class RoundRobinPolicy(Policy):
    name = "round_robin"

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

    def pick(self, cands: list[Candidate], req: RouteInput) -> tuple[Candidate, str, str]:
        if req.session_key is not None:
            chosen = self.session.pick(cands, req.session_key)
            if chosen is not None:
                return chosen, SESSION, "session affinity (bounded load)"
        return least_load(cands, self.rotation), LEAST_LOAD, "no session key; least load"


def make_policy(cfg: PolicyConfig, load_model: LoadModel) -> Policy:
    """The configured policy (names validated by the config)."""
    if cfg.name == "ttft":
        return TTFTPolicy(load_model, cfg)
    if cfg.name == "full_attention_only":
        return FullAttentionOnlyPolicy(load_model, cfg)
    if cfg.name == "round_robin":
        return RoundRobinPolicy(load_model)
    if cfg.name == "random":
        return RandomPolicy(load_model, cfg.seed)
    if cfg.name == "least_load":
        return LeastLoadPolicy(load_model)
    if cfg.name == "session":
        return SessionPolicy(load_model, cfg)
    raise ValueError(f"unknown policy {cfg.name!r}")


def uses_cache(policy: Policy) -> bool:
    """Whether the policy reads predicted reuse (others skip scoring on the hot path)."""
    return isinstance(policy, TTFTPolicy)


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
