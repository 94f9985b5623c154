"""kvroute's own reimplementation of vLLM's KV cache decisions (reference §5-§7).

`SimCache` implements the cache protocol of `kvroute.sim.cache_api`: block pool with refcounts and
LRU
eviction, per-group managers (full attention, sliding window, Mamba align mode), the hybrid
fixed-point lookup, sparse retention, partial (hash-unit) hits, and vLLM-shaped events.
"""

from kvroute.sim.cache.backend import SimCache

__all__ = ["SimCache"]
