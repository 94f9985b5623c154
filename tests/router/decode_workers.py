"""Decode-role workers for the decode-choice tests (no engines behind them)."""

from __future__ import annotations

from kvroute.router.config import BreakerConfig, WorkerSpec
from kvroute.router.fleet.workers import Worker, WorkerRegistry


def decoders(n: int) -> list[Worker]:
    """``n`` registered decode workers named d0..d{n-1}, on model ``m``."""
    reg = WorkerRegistry(BreakerConfig())
    return [
        reg.add(
            WorkerSpec(name=f"d{i}", url=f"http://127.0.0.1:{9100 + i}", model="m", role="decode")
        )
        for i in range(n)
    ]
