"""`tier_load`: the time to load the prompt tokens a worker holds in a lower KV tier.

A worker with KV offloading (vLLM's `OffloadingConnector`) restores prompt tokens beyond its
GPU hit from its CPU tier, and then from a storage tier, by a copy instead of a prefill
(docs/reference/vllm-kv-events.md section 10.4). Those tokens leave the `prefill` term
(`Candidate.uncached` excludes them) and cost `Candidate.cpu_tokens /
policy.cpu_tier_tokens_per_s + Candidate.storage_tokens / policy.storage_tier_tokens_per_s`
here: GPU tokens are free, lower-tier tokens cost their tier's transfer, the rest its prefill.
With `policy.learn_cpu_tier_rate`, each worker's CPU tokens are priced at the rate learned from
its engine's counters (`kvroute.router.fleet.cpu_tier_rate`) instead. Off (no values) when no
candidate holds anything in a lower tier.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.router.routing.records import Candidate
from kvroute.router.routing.terms.base import Pricing, Term


class TierLoad(Term):
    name = "tier_load"
    config = (
        "policy.cpu_tier_tokens_per_s",
        "policy.learn_cpu_tier_rate",
        "policy.storage_tier_tokens_per_s",
    )

    def values(self, cands: Sequence[Candidate], p: Pricing) -> list[float] | None:
        if not p.req.tiers:
            return None
        configured = self.cfg.cpu_tier_tokens_per_s
        storage = 1.0 / self.cfg.storage_tier_tokens_per_s
        if not self.cfg.learn_cpu_tier_rate:
            cpu = 1.0 / configured
            return [c.cpu_tokens * cpu + c.storage_tokens * storage for c in cands]
        return [
            (
                c.cpu_tokens / c.worker.load.cpu_tier.tokens_per_s(configured)
                if c.cpu_tokens
                else 0.0
            )
            + c.storage_tokens * storage
            for c in cands
        ]
