"""CPU of the router's per-worker bookkeeping at 1,024 and 4,096 workers, without engines.

    PYTHONPATH=. python bench/fleet_registry_bench.py [--workers 1024 4096]

- start-up: N workers are added, then report their model one by one in random order, with a
  request's model resolved (`route`, `serving`) after each change, as under traffic;
- a round of the `/metrics` job when no worker's read is due (the scrape backoff's steady
  state on an idle fleet), which runs every `load.metrics_interval_s`.
Prints CPU seconds (process time): the figure that holds on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import random
import time

from kvroute.router.config import BreakerConfig, WorkerSpec
from kvroute.router.fleet.health import Periodic
from kvroute.router.fleet.workers import Worker, WorkerRegistry


async def _probe(w: Worker) -> None:
    if not w.load.scrape.due(0.0):
        return


def _due(w: Worker) -> bool:
    return w.load.scrape.due(0.0)


def measure(n: int, rounds: int) -> None:
    reg = WorkerRegistry(BreakerConfig(), max_workers=n)
    c0 = time.process_time()
    ws = [
        reg.add(WorkerSpec(name=f"w{i}", url=f"http://10.0.{i // 250}.{i % 250}:8000"))
        for i in range(n)
    ]
    random.Random(1).shuffle(ws)
    for w in ws:
        reg.set_models(w, {"m": {"id": "m"}})
        reg.route("m")
        reg.serving("m")
    start_up = time.process_time() - c0
    for w in ws:
        w.load.scrape.due_at = 1e9  # none due
    # the due check where this version of Periodic takes one (older ones start every probe)
    extra = (_due,) if "due" in inspect.signature(Periodic).parameters else ()
    job = Periodic("metrics", reg, _probe, 1.0, *extra)

    async def run() -> float:
        t = time.process_time()
        for _ in range(rounds):
            await job.run_once()
        return (time.process_time() - t) / rounds

    per_round = asyncio.run(run())
    print(
        f"{n} workers: start-up {start_up:.3f} CPU-s; "
        f"/metrics round with none due {per_round * 1e3:.2f} CPU-ms",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workers", type=int, nargs="*", default=[1024, 4096])
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    for n in args.workers:
        measure(n, args.rounds)


if __name__ == "__main__":
    main()
