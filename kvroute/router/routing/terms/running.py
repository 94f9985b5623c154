"""`running` and `home`: what the requests already running on a worker cost a new one.

Each running request (this router's and, from the engine's /metrics, other replicas') adds
`policy.tokens_per_running` prefill tokens of time (decode steps interleave with the new
prefill, and a worker with many conversations evicts their state sooner). On the request's
home, the one worker whose predicted reuse beats every other's by at least
`policy.hash_unit` tokens (where its conversation lives), the charge is
`policy.tokens_per_running_home` instead (`home`): staying there adds no conversation to that
cache. `running` is 0 on the home and `home` 0 elsewhere, so exactly one of them prices a
worker's running requests.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.router.routing.records import Candidate
from kvroute.router.routing.terms.base import Pricing, Term


class Running(Term):
    name = "running"
    config = ("policy.tokens_per_running",)

    def values(self, cands: Sequence[Candidate], p: Pricing) -> list[float]:
        per = self.cfg.tokens_per_running * p.seconds_per_token
        out = [per * c.running for c in cands]
        if p.home_at >= 0:
            out[p.home_at] = 0.0
        return out


class Home(Term):
    name = "home"
    config = ("policy.tokens_per_running_home", "policy.hash_unit")

    def values(self, cands: Sequence[Candidate], p: Pricing) -> list[float] | None:
        at = p.home_at
        if at < 0:
            return None
        out = [0.0] * len(cands)
        out[at] = self.cfg.tokens_per_running_home * p.seconds_per_token * cands[at].running
        return out
