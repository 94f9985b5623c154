"""`queue`: the wait behind the prefill already queued on the worker.

queued prefill tokens x seconds per token x `policy.queue_weight` (below 1: a request stays
with its cache longer before load is balanced), in full (weight 1) on a worker that reuses
nothing of the prompt when `policy.full_queue_without_reuse` is on. Queued tokens are this
router's in-flight uncached prompt tokens plus other replicas' waiting requests at the
learned mean prompt size (`kvroute.router.fleet.load`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.router.routing.records import Candidate
from kvroute.router.routing.terms.base import Pricing, Term


class Queue(Term):
    name = "queue"
    config = ("policy.queue_weight", "policy.full_queue_without_reuse")

    def values(self, cands: Sequence[Candidate], p: Pricing) -> list[float]:
        weight = self.cfg.queue_weight
        # without reuse there, the queue is waited in full (two cold re-prefills would
        # otherwise stack on one busy worker)
        cold = 1.0 if self.cfg.full_queue_without_reuse else weight
        inv = p.seconds_per_token
        return [(weight if c.reuse else cold) * (c.queued_tokens * inv) for c in cands]
