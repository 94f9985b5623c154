"""How fast is the simulator itself? (so that benchmarks know it is not their bottleneck)

1. Cache + scheduler, no HTTP, no sleeping: requests/s and steps/s through
kvroute.sim.engine.scheduler
   on SimCache, per model profile, with prompts that share prefixes.
2. One engine over HTTP at a very high speed factor: completed requests/s with 32 concurrent
   clients (the Python HTTP path, tokenization and event publishing included).

    python -m bench.sim_engine [--smoke]
Prints a table and writes bench/results/sim_engine.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import time
from pathlib import Path
from typing import Any

import httpx

from kvroute.sim.cache import SimCache
from kvroute.sim.cache_api import CacheRequest, CacheSpec
from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.engine.scheduler import Scheduler
from kvroute.sim.profiles import PROFILES
from kvroute.sim.publisher import PublisherConfig
from kvroute.sim.server import start_engine

RESULTS = Path(__file__).resolve().parent / "results" / "sim_engine.json"


def bench_core(profile: str, requests: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    spec = CacheSpec(groups=PROFILES[profile], num_blocks=4096, max_model_len=8192)
    sched = Scheduler(SimCache(spec), max_num_seqs=64, max_num_scheduled_tokens=2048)
    prefixes = [[rng.randrange(5, 4000) for _ in range(512)] for _ in range(8)]
    for i in range(requests):
        tokens = rng.choice(prefixes)[: rng.randint(64, 512)]
        tokens += [rng.randrange(5, 4000) for _ in range(rng.randint(16, 256))]
        sched.add(CacheRequest(f"r{i}", tuple(tokens), max_tokens=rng.randint(8, 64)))
    steps = 0
    t0 = time.perf_counter()
    while sched.has_work():
        plan = sched.schedule()
        sched.complete(plan, lambda _r: 42, lambda _r, _t: False)
        steps += 1
    dt = time.perf_counter() - t0
    return {
        "profile": profile,
        "requests": requests,
        "seconds": round(dt, 3),
        "requests_per_s": round(requests / dt, 1),
        "steps_per_s": round(steps / dt, 1),
        "prefix_hit_ratio": round(sched.prefix_hits / max(1, sched.prefix_queries), 3),
    }


async def bench_http(requests: int, concurrency: int = 32) -> dict[str, Any]:
    config = EngineConfig(speed=1e6, num_blocks=4096, max_model_len=4096)
    running = await start_engine(config, PublisherConfig())
    rng = random.Random(1)
    prompts = [" ".join(f"w{rng.randrange(500)}" for _ in range(200)) for _ in range(16)]
    sem = asyncio.Semaphore(concurrency)
    try:
        async with httpx.AsyncClient(base_url=running.url, timeout=60) as client:

            async def one(i: int) -> None:
                async with sem:
                    body = {
                        "prompt": prompts[i % len(prompts)] + f" {i}",
                        "max_tokens": 16,
                        "ignore_eos": True,
                    }
                    r = await client.post("/v1/completions", json=body)
                    r.raise_for_status()

            t0 = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(requests)))
            dt = time.perf_counter() - t0
    finally:
        await running.aclose()
    return {
        "requests": requests,
        "concurrency": concurrency,
        "seconds": round(dt, 3),
        "requests_per_s": round(requests / dt, 1),
        "output_tokens_per_s": round(requests * 16 / dt, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny run (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    n_core, n_http = (40, 20) if args.smoke else (2000, 600)
    core = [bench_core(p, n_core) for p in sorted(PROFILES)]
    http = asyncio.run(bench_http(n_http))
    for row in core:
        print(
            f"core {row['profile']:>5}: {row['requests_per_s']:>8} req/s "
            f"{row['steps_per_s']:>8} steps/s  hit ratio {row['prefix_hit_ratio']}"
        )
    print(
        f"http: {http['requests_per_s']} req/s, {http['output_tokens_per_s']} output tok/s "
        f"({http['concurrency']} clients)"
    )
    result = {
        "benchmark": "sim_engine",
        "smoke": args.smoke,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "core": core,
        "http": http,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
