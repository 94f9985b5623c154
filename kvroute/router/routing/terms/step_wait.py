"""`step_wait`: the wait for the engine step in flight on a busy worker.

`policy.step_wait_weight` x the expected seconds until the running step ends (vLLM schedules
a new prefill when a step ends; each worker's step period and phase are learned from the
chunks the router relays, `kvroute.router.fleet.step_clock`). 0 on an idle worker. Off (0)
by default.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.router.routing.records import Candidate
from kvroute.router.routing.terms.base import Pricing, Term


class StepWait(Term):
    name = "step_wait"
    config = ("policy.step_wait_weight",)

    def values(self, cands: Sequence[Candidate], p: Pricing) -> list[float] | None:
        weight = self.cfg.step_wait_weight
        if not weight:
            return None
        return [weight * c.step_wait_s for c in cands]
