"""kvroute's index: what every worker's KV cache holds and how much of a request vLLM will
reuse there, with vLLM's own rules for full-attention, sliding-window and Mamba groups.

Pure: no I/O, no clock, no threads.
"""

from kvroute.indexer.fleet_index import FleetIndex
from kvroute.indexer.group_cache import GroupCache
from kvroute.indexer.keys import Namespace, content_keys
from kvroute.indexer.results import GroupScore, WorkerScore, WorkerStats
from kvroute.indexer.tiers import TierIndex, TierTokens

__all__ = [
    "FleetIndex",
    "GroupCache",
    "GroupScore",
    "Namespace",
    "TierIndex",
    "TierTokens",
    "WorkerScore",
    "WorkerStats",
    "content_keys",
]
