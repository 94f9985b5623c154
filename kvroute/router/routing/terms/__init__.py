"""The named terms of a worker's cost (see docs/policy.md).

A policy prices each eligible worker as the sum of these terms, in seconds, in the order of
`ORDER` (a fixed order keeps the floating-point sums, and so the decisions, reproducible).
`TERMS` maps a term's name to its class; a policy lists the names it prices
(`Policy.terms`).
"""

from __future__ import annotations

from kvroute.router.routing.terms.base import Pricing, Term
from kvroute.router.routing.terms.junction import Junction
from kvroute.router.routing.terms.placement import Placement
from kvroute.router.routing.terms.prefill import Prefill
from kvroute.router.routing.terms.queue import Queue
from kvroute.router.routing.terms.running import Running
from kvroute.router.routing.terms.tier_load import TierLoad

__all__ = ["LOAD_TERMS", "ORDER", "TERMS", "Pricing", "Term"]

TERMS: dict[str, type[Term]] = {
    t.name: t for t in (Queue, Prefill, TierLoad, Running, Junction, Placement)
}
ORDER: tuple[str, ...] = tuple(TERMS)
# the estimated TTFT, which every policy computes (the proxy releases queued prefill by it)
LOAD_TERMS: tuple[str, ...] = tuple(n for n in ORDER if TERMS[n].time)
