"""`home_bound`: the home's discount taken back when the home is crowded.

Where the home runs more than `policy.home_load_bound` times the fleet's mean running
requests, its running requests are charged the difference between `policy.tokens_per_running`
and `policy.tokens_per_running_home`, so it pays the same as any worker: a prefix only one
worker holds (a tenant's system prompt) otherwise draws every new conversation there, and
their prefills evict the state of the conversations already there. 0 turns the bound off.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.router.routing.records import Candidate
from kvroute.router.routing.terms.base import Pricing, Term


class HomeBound(Term):
    name = "home_bound"
    config = (
        "policy.home_load_bound",
        "policy.tokens_per_running",
        "policy.tokens_per_running_home",
    )

    def values(self, cands: Sequence[Candidate], p: Pricing) -> list[float] | None:
        cfg = self.cfg
        at, bound = p.home_at, cfg.home_load_bound
        if at < 0 or bound <= 0:
            return None
        running = cands[at].running
        if running <= bound * (sum(c.running for c in cands) / len(cands)):
            return None
        inv = p.seconds_per_token
        extra = cfg.tokens_per_running * inv - cfg.tokens_per_running_home * inv
        out = [0.0] * len(cands)
        out[at] = extra * running
        return out
