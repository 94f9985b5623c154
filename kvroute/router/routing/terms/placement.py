"""`placement`: the expected re-prefill of the conversations a placement pushes out of a pool.

A worker's pool holds `C` tokens (`vllm:cache_config_info`, `kvroute.router.fleet.capacity`).
The router expects its working set back (`kvroute.router.routing.working_set`): the other
conversations on the worker, most recently routed first, fill the pool from the top and the
pool keeps the first `C - r` of their tokens while this request's conversation holds `r`
there (its reuse). Serving the request there makes it hold all `n` prompt tokens, so the
others' tokens between positions `C - n` and `C - r` leave the pool now. Each such token
costs its prefill time, weighted by the chance that its conversation returns before it would
have been evicted anyway: `1 - exp(-H / interval)`, where `interval` is the conversation's
observed gap between turns and `H` how long the token would have stayed (the pool room left
below it, `C - position`, over the worker's write rate; unbounded on an idle worker).

    placement(w) = policy.placement_weight x seconds per token x sum over displaced tokens
                   of P(return within H)

A worker whose working set fits costs nothing, so new conversations spread to where they
fit; when none fits, the least recently routed conversations that return least often per
token are the ones given up. A cost to other conversations, not this request's time to
first token: it ranks (like the junction credit) and is not part of the estimate. Off (no
values) with `policy.placement_weight` 0 or on a worker whose pool the engine does not report.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvroute.router.routing.records import Candidate, PlacementInput
from kvroute.router.routing.terms.base import Pricing, Term


def displaced_tokens(placement: PlacementInput, worker: str, n: int, reuse: int) -> float:
    """The expected number of other conversations' tokens that placing a prompt of `n`
    tokens reusing `reuse` on `worker` pushes out before they return (0 when the pool is
    unknown or large enough)."""
    cap = placement.capacity.get(worker)
    if cap is None or n <= reuse:
        return 0.0
    ws = placement.working_set
    own = placement.own
    lo = cap - n
    hi = cap - reuse
    if hi <= 0:
        hi = 0
    if lo < 0:
        lo = 0
    if hi <= lo:
        return 0.0
    others = ws.tokens(worker) - (own.tokens if own is not None and own.worker == worker else 0)
    if others <= lo:
        return 0.0  # the working set fits beside the request
    writes = ws.write_rate(worker, placement.now)
    total = 0.0
    start = 0  # the entry's first position, from the newest token of the pool
    for entry in ws.newest_first(worker):
        if own is not None and entry.ident == own.ident:
            continue
        end = start + entry.tokens
        if end > lo:
            a = start if start > lo else lo
            b = end if end < hi else hi
            if b > a:
                if writes > 0:
                    stay_s = (cap - a) / writes
                    p = -math.expm1(-ws.return_rate(entry) * stay_s)
                else:
                    p = 1.0
                total += (b - a) * p
        if end >= hi:
            break
        start = end
    return total


class Placement(Term):
    name = "placement"
    config = (
        "policy.placement_weight",
        "policy.working_set_max_conversations",
        "policy.working_set_idle_s",
        "policy.return_interval_s",
    )
    time = False

    def values(self, cands: Sequence[Candidate], p: Pricing) -> list[float] | None:
        placement = p.req.placement
        weight = self.cfg.placement_weight
        if placement is None or weight <= 0:
            return None
        n = p.req.n_tokens
        per = weight * p.seconds_per_token
        return [per * displaced_tokens(placement, c.name, n, c.reuse or 0) for c in cands]
