"""`running`: what the requests already running on a worker cost a new one.

Each running request (this router's and, from the engine's /metrics, other replicas') adds
`policy.tokens_per_running` prefill tokens of time: decode steps interleave with the new
prefill, and a worker with many conversations evicts their state sooner.
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
        return [per * c.running for c in cands]
