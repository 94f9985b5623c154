"""The simulated engine's CPU tier: vLLM 0.33's native KV offloading (reference §10)."""

from kvroute.sim.offload.connector import OffloadConfig, OffloadConnector, check_offloadable
from kvroute.sim.offload.tier import MEDIUM_CPU, ChunkInfo, CpuTier

__all__ = [
    "MEDIUM_CPU",
    "ChunkInfo",
    "CpuTier",
    "OffloadConfig",
    "OffloadConnector",
    "check_offloadable",
]
