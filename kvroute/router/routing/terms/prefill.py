"""`prefill`: the request's own uncached prompt tokens, at the prefill rate.

(prompt tokens - predicted reuse) / `policy.prefill_tokens_per_s` (or the rate measured from
streamed first bytes with `policy.learn_prefill_rate`). This is the term that draws a
request to its cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.router.routing.records import Candidate
from kvroute.router.routing.terms.base import Pricing, Term


class Prefill(Term):
    name = "prefill"
    config = ("policy.prefill_tokens_per_s", "policy.learn_prefill_rate")

    def values(self, cands: Sequence[Candidate], p: Pricing) -> list[float]:
        inv = p.seconds_per_token
        return [c.uncached * inv for c in cands]
