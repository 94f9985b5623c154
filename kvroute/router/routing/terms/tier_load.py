"""`tier_load`: the time to load the prompt tokens a worker holds in a lower KV tier.

A worker with KV offloading (vLLM's `OffloadingConnector`) restores prompt tokens beyond its
GPU hit from its CPU tier, and then from a storage tier, by a copy instead of a prefill
(docs/reference/vllm-kv-events.md section 10.4). Those tokens leave the `prefill` term
(`Candidate.uncached` excludes them) and cost `Candidate.cpu_tokens /
policy.cpu_tier_tokens_per_s + Candidate.storage_tokens / policy.storage_tier_tokens_per_s`
here: GPU tokens are free, lower-tier tokens cost their tier's transfer, the rest its prefill.
Off (no values) when no candidate holds anything in a lower tier.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.router.routing.records import Candidate
from kvroute.router.routing.terms.base import Pricing, Term


class TierLoad(Term):
    name = "tier_load"
    config = ("policy.cpu_tier_tokens_per_s", "policy.storage_tier_tokens_per_s")

    def values(self, cands: Sequence[Candidate], p: Pricing) -> list[float] | None:
        if not p.req.tiers:
            return None
        cpu = 1.0 / self.cfg.cpu_tier_tokens_per_s
        storage = 1.0 / self.cfg.storage_tier_tokens_per_s
        return [c.cpu_tokens * cpu + c.storage_tokens * storage for c in cands]
