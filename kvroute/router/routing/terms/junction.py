"""`junction`: a credit (negative seconds) for serving a hybrid model's shared prefix where
full attention already holds it.

On hybrid models vLLM keeps sliding-window and Mamba state only at replay boundaries and
shared-prefix junctions: a prefix that a worker's full-attention blocks hold becomes
reusable there once a request sharing it is served there (vLLM saves the state at the
junction). Greedy "most reuse now" never makes that investment, so the next requests
sharing the prefix keep paying for it. The credit is `policy.affinity_weight` x the prefill
time of the tokens the worker's full attention covers beyond its reuse (`Candidate.affinity`).
With `policy.junction_shared_only` only the tokens before the conversation's own history
(`RouteInput.own_from`, remembered for `policy.sharing_max_keys` prompt keys) and beyond the
fleet's best reuse count: a conversation's own history gains nothing, and a junction below
the fleet's best reuse is a second copy, which the load terms price. A credit ranks only; it
is not part of the estimated TTFT.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.router.routing.records import Candidate
from kvroute.router.routing.terms.base import Pricing, Term


class Junction(Term):
    name = "junction"
    config = ("policy.affinity_weight", "policy.junction_shared_only", "policy.sharing_max_keys")
    time = False

    def values(self, cands: Sequence[Candidate], p: Pricing) -> list[float] | None:
        """Sets each covered candidate's `affinity` (tokens) and credits it."""
        weight = self.cfg.affinity_weight
        req = p.req
        coverage = req.coverage
        if not coverage or weight <= 0:
            return None
        limit = req.n_tokens
        floor = 0
        if self.cfg.junction_shared_only:
            if req.own_from is not None:
                limit = min(limit, req.own_from)
            floor = max((c.reuse or 0 for c in cands), default=0)
        for c in cands:
            covered = coverage.get(c.name)
            if covered:
                c.affinity = max(0, min(covered, limit) - max(c.reuse or 0, floor))
        credit = weight * p.seconds_per_token
        return [-(credit * c.affinity) if c.affinity else 0.0 for c in cands]
