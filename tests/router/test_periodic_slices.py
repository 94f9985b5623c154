"""Periodic probes over a large fleet: slices of `SLICE` workers spread over the interval,
only due workers probed, removed workers skipped."""

from __future__ import annotations

import asyncio

from kvroute.router.config import BreakerConfig, WorkerSpec
from kvroute.router.fleet.health import SLICE, Periodic
from kvroute.router.fleet.workers import Worker, WorkerRegistry


def _fleet(n: int) -> WorkerRegistry:
    reg = WorkerRegistry(BreakerConfig())
    for i in range(n):
        reg.add(WorkerSpec(name=f"w{i}", url=f"http://127.0.0.1:{9000 + i}"))
    return reg


def test_a_round_is_cut_into_slices_spread_over_the_interval() -> None:
    n, spread = 4 * SLICE + 3, 0.5  # five slices, 0.1 s apart
    reg = _fleet(n)
    seen: list[tuple[str, float]] = []
    active = peak = 0

    async def probe(w: Worker) -> None:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        seen.append((w.name, asyncio.get_running_loop().time()))
        await asyncio.sleep(0.001)
        active -= 1

    async def main() -> float:
        t0 = asyncio.get_running_loop().time()
        await Periodic("p", reg, probe, 1.0).run_once(spread_s=spread)
        return t0

    t0 = asyncio.run(main())
    assert sorted(name for name, _ in seen) == sorted(reg.names())  # each worker once
    assert peak <= SLICE
    starts = sorted({round(t - t0, 2) for _, t in seen})
    first, last = min(t for _, t in seen) - t0, max(t for _, t in seen) - t0
    assert first >= 0.09  # the first slice waits one gap
    assert last >= 0.49  # the fifth slice starts after five gaps
    assert len(starts) >= 5


def test_only_due_workers_are_probed_and_removed_ones_skipped() -> None:
    reg = _fleet(3 * SLICE)
    probed: list[str] = []
    due_asked: list[str] = []

    async def probe(w: Worker) -> None:
        probed.append(w.name)
        if w.name == "w0":
            reg.remove(f"w{SLICE}")  # leaves while the round is under way

    def due(w: Worker) -> bool:
        due_asked.append(w.name)
        return int(w.name[1:]) % 2 == 0

    asyncio.run(Periodic("p", reg, probe, 1.0, due).run_once())
    want = {f"w{i}" for i in range(3 * SLICE) if i % 2 == 0 and i != SLICE}
    assert set(probed) == want and len(probed) == len(want)
    assert f"w{SLICE}" not in due_asked
