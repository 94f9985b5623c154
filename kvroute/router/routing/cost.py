"""A worker's cost for one request: its load as observed, priced by the named terms.

`LoadModel.price` builds one `Candidate` per eligible worker from its load (this router's
in-flight requests and the engine's last /metrics scrape), marks it saturated
(the guard the policy spills on), then asks each term (`kvroute.router.routing.terms`) for
its value on every candidate and sums them: the time terms give `Candidate.est_ttft_s`, all
of them `Candidate.cost_s`, and `Candidate.terms` keeps each value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import add

from kvroute.router.config import PolicyConfig
from kvroute.router.fleet.workers import Worker
from kvroute.router.routing.records import Candidate, RouteInput
from kvroute.router.routing.terms import LOAD_TERMS, TERMS, Pricing, Term


@dataclass(frozen=True, slots=True)
class TermSet:
    """The terms a policy prices, in summing order: the time terms (the estimated TTFT)
    first, then the credits."""

    terms: tuple[Term, ...]
    names: tuple[str, ...] = field(init=False)
    n_time: int = field(init=False)  # how many leading terms are time terms

    def __post_init__(self) -> None:
        n_time = sum(1 for t in self.terms if t.time)
        if n_time == 0 or any(not t.time for t in self.terms[:n_time]):
            raise ValueError("a policy prices at least one time term, and all before credits")
        object.__setattr__(self, "names", tuple(t.name for t in self.terms))
        object.__setattr__(self, "n_time", n_time)


class LoadModel:
    """Turns workers' load and a request's predicted reuse into priced candidates."""

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
        self._load_terms = self.terms(LOAD_TERMS)

    def terms(self, names: Sequence[str]) -> TermSet:
        """The named terms (KeyError for an unknown name), built on this model's config."""
        return TermSet(tuple(TERMS[n](self.cfg) for n in names))

    def seconds_per_token(self) -> float:
        """Prefill seconds per uncached token, as the estimates use it now."""
        return 1.0 / self._rate()

    def candidate(self, worker: Worker, reuse: int | None, n_tokens: int, now: float) -> Candidate:
        return self.candidates([worker], {worker.name: reuse}, n_tokens, now)[0]

    def candidates(
        self, workers: Sequence[Worker], reuse: Mapping[str, int | None], n_tokens: int, now: float
    ) -> list[Candidate]:
        """Candidates priced by the load terms (the estimated TTFT) only."""
        return self.price(workers, RouteInput(n_tokens, reuse, None), now, self._load_terms)

    def price(
        self, workers: Sequence[Worker], req: RouteInput, now: float, terms: TermSet
    ) -> list[Candidate]:
        """One Candidate per worker, priced by `terms` (summed in their order)."""
        inv_rate = self.seconds_per_token()
        cands = self._observe(workers, req, now, inv_rate)
        if not cands:
            return cands
        p = Pricing(inv_rate, req)
        columns = [t.values(cands, p) for t in terms.terms]
        names, k = terms.names, terms.n_time
        # Column by column in the terms' order (C-level adds: the cheapest for large fleets),
        # so each candidate's sum adds its values left to right as a sum written out by hand
        # would; an off term (None) adds exactly nothing.
        zeros = [0.0] * len(cands)
        est: list[float] | None = None
        for col in columns[:k]:
            if col is not None:
                est = col if est is None else list(map(add, est, col))
        if est is None:
            est = zeros
        cost = est
        for col in columns[k:]:
            if col is not None:
                cost = list(map(add, cost, col))
        rows = zip(*[zeros if col is None else col for col in columns], strict=True)
        for c, e, total, row in zip(cands, est, cost, rows, strict=True):
            c.est_ttft_s = e
            c.cost_s = total
            c.term_names = names
            c.term_values = row
        return cands

    def _observe(
        self, workers: Sequence[Worker], req: RouteInput, now: float, inv_rate: float
    ) -> list[Candidate]:
        """Each worker's load and reuse, and whether it is saturated (a tight loop: this runs
        for every worker per request)."""
        cfg = self.cfg
        n_tokens = req.n_tokens
        sat_queue = cfg.saturation_queue_s
        max_running = cfg.max_running_per_worker
        kv_sat = cfg.kv_usage_saturation
        stale = self._stale
        mean_prompt = self._mean_prompt()
        get = req.reuse.get
        tiers = req.tiers or {}
        out: list[Candidate] = []
        append = out.append
        for worker in workers:
            load = worker.load
            queued = load.queued_prefill_tokens
            running = load.running
            kv = None
            m = load.engine
            if m is not None and now - m.at <= stale:
                others_total, others_waiting = m.others  # `WorkerLoad.others`, not stale
                queued += round(others_waiting * mean_prompt)
                running += others_total
                kv = m.kv_usage
            name = worker.spec.name
            r = get(name)
            if r is None:
                uncached = n_tokens
            elif r >= n_tokens:
                uncached = 0
            else:
                uncached = n_tokens - r
            tier = tiers.get(name) if tiers else None
            if tier is not None:  # loaded from a lower tier: not prefilled
                uncached = max(0, uncached - tier.total)
            saturated = (
                queued * inv_rate > sat_queue
                or running >= max_running
                or (kv is not None and kv >= kv_sat)
            )
            cand = Candidate(worker, r, uncached, running, queued, kv, 0.0, saturated)
            if tier is not None:
                cand.cpu_tokens, cand.storage_tokens = tier.cpu, tier.storage
            append(cand)
        return out
