"""The index alone, in one process, on the fleet-scale workload: what one core pays per block
ingested and per request scored, and the memory per engine, at N engines.

The same bytes the fleet-scale feed sends (its `Fleet`, `bench.fleet_feed`) are decoded
(`SubscribeResponse.FromString`, as the router does) and applied to the router's own index
view (`kvroute.router.app.build_index`): first each engine's start snapshot (a full cache),
then `--batch-seconds` of every engine's busy batches. Scoring calls the view the way the
router's default policy does (`reach`, then `tiers`) for 8K- and 32K-token prompts that
extend a conversation one engine holds. CPU is this process's own (time.process_time), so a
busy machine slows the run but not the figures much.

    python -m bench.fleet_index_cost --template T.pkl --engines 64 256 1024
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import random
import resource
import statistics
import time
from pathlib import Path
from typing import Any

from bench.fleet_feed import Fleet, Template, engine_token
from kvroute.proto.events_pb2 import SubscribeRequest, SubscribeResponse
from kvroute.router.app import build_index
from kvroute.router.config import RouterConfig

SIZES = (8192, 32768)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def measure(
    template: Template, prompts: list[tuple[int, ...]], engines: int, batch_seconds: float
) -> dict[str, Any]:
    index = build_index(RouterConfig())
    fleet = Fleet(template, engines, rate_scale=1.0, restart_interval_s=1e12)
    names = [f"e{k}" for k in range(engines)]
    subs = [fleet.engines[k].subscribe(SubscribeRequest(dp_rank=k)) for k in range(engines)]
    rss0 = _rss_bytes()
    # start snapshots: a full cache per engine
    cpu = 0.0
    blocks = 0
    for name, sub in zip(names, subs, strict=True):
        raw = sub.queue.get_nowait()
        t0 = time.process_time()
        snap = SubscribeResponse.FromString(raw).snapshot
        index.apply_snapshot(name, snap)
        cpu += time.process_time() - t0
        blocks += sum(len(e.block_hashes) for e in snap.events)
    rss1 = _rss_bytes()
    out: dict[str, Any] = {
        "engines": engines,
        "snapshot_blocks": blocks,
        "snapshot_us_per_block": round(cpu / max(blocks, 1) * 1e6, 3),
        "rss_mib_per_engine": round((rss1 - rss0) / engines / 2**20, 3),
        "index_entries": sum(s.entries for s in (index.stats(n) for n in names) if s is not None),
    }
    # busy batches: every engine's next `batch_seconds`, one modelled second at a time
    cpu, blocks, batches = 0.0, 0, 0
    start = time.time()
    for engine in fleet.engines:  # their busy time starts now, not when they subscribed
        engine.origin_wall = start
    for second in range(1, int(batch_seconds) + 1):
        for k, engine in enumerate(fleet.engines):
            engine.send_due(start + second)
            queue = subs[k].queue
            while not queue.empty():
                raw = queue.get_nowait()
                t0 = time.process_time()
                message = SubscribeResponse.FromString(raw)
                if message.HasField("batch"):
                    index.apply(names[k], message.batch)
                    cpu += time.process_time() - t0
                    # counted outside the timed part: the count is the benchmark's, not
                    # the router's (it was timed before 2026-12-06's ingest section)
                    blocks += sum(len(e.block_hashes) for e in message.batch.events)
                    batches += 1
                else:
                    index.apply_snapshot(names[k], message.snapshot)
                    cpu += time.process_time() - t0
    out["batches"] = batches
    out["batch_us_per_block"] = round(cpu / max(blocks, 1) * 1e6, 3)
    out["batch_us_per_batch"] = round(cpu / max(batches, 1) * 1e6, 1)
    out["busy_engine_cpu_per_s"] = round(cpu / max(batch_seconds, 1e-9) / engines, 5)
    out["engines_per_core_ingest"] = round(1.0 / max(out["busy_engine_cpu_per_s"], 1e-12), 1)
    rng = random.Random(1)
    for size in SIZES:
        times = []
        for _ in range(40):
            k = rng.randrange(engines)
            ids = [engine_token(k), *rng.choice(prompts)[1:size]]
            ids += [rng.randrange(5, 32_000) for _ in range(size - len(ids))]
            t0 = time.process_time()
            reuse, _coverage = index.reach(ids)
            index.tiers(ids, reuse)
            times.append(time.process_time() - t0)
        times.sort()
        out[f"score_{size}_p50_ms"] = round(statistics.median(times) * 1000, 3)
        out[f"score_{size}_p99_ms"] = round(times[int(0.99 * (len(times) - 1))] * 1000, 3)
    out["max_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--template", type=Path, required=True, help="from fleet_scale_bench")
    ap.add_argument("--engines", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--batch-seconds", type=float, default=5.0, help="modelled, per engine")
    ap.add_argument("--out", type=Path, default=None, help="JSON lines appended here")
    args = ap.parse_args(argv)
    template = Template.load(args.template)
    prompts = pickle.loads(args.template.read_bytes())["prompts"]
    for n in args.engines:
        row = asyncio.run(measure(template, prompts, n, args.batch_seconds))
        line = json.dumps(row)
        print(line, flush=True)
        if args.out is not None:
            with args.out.open("a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
