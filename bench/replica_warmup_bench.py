"""How long a new router replica takes to be fully warm, in front of a fleet whose caches are
full of realistic content.

A fleet of simulated engines (each with its bridge) is filled to a fraction of its KV pool with
distinct long documents (asked directly of each engine, so every engine holds different
content); an old replica follows it. Then, per run, a new `kvroute serve` process is started and
timed from spawn until:

- `http_s`: it answers HTTP (its app has started);
- `snapshots_s`: every worker's event stream is live with a snapshot applied;
- `warm_s`: its /admin/score answers (chosen worker, predicted reuse of every worker, reason)
  equal the old replica's for a probe set of cached documents and follow-ups.

    python -m bench.replica_warmup_bench [--engines 4] [--num-blocks 16384] [--runs 3] [--smoke]

Writes bench/results/replicas.json (smoke: --out, or replicas_smoke.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.loopback import Loopback, Router
from bench.traffic import completion_body, metric, metrics, post_json, predictions, score, workers
from bench.words import text

RESULTS = Path(__file__).resolve().parent / "results"


async def fill(
    http: aiohttp.ClientSession, engine_url: str, target_tokens: int, words: int, seed: int
) -> tuple[list[str], int]:
    """Send distinct documents to one engine until `target_tokens` prompt tokens went in."""
    rng = random.Random(seed)
    docs: list[str] = []
    total = 0
    while total < target_tokens:
        batch = [text(rng, words) for _ in range(8)]
        answers = await asyncio.gather(
            *(
                post_json(http, engine_url + "/v1/completions", completion_body(d, max_tokens=1))
                for d in batch
            )
        )
        for doc, (status, data, _) in zip(batch, answers, strict=True):
            if status == 200:
                docs.append(doc)
                total += int(data["usage"]["prompt_tokens"])
    return docs, total


def comparable(scored: dict[str, Any]) -> tuple[Any, ...]:
    chosen = scored["chosen"] if scored["reason"] != "least_load" else None
    return scored["reason"], chosen, predictions(scored)


async def one_run(
    lb: Loopback,
    http: aiohttp.ClientSession,
    config: dict[str, Any],
    old: Router,
    probes: list[dict[str, Any]],
    expected: list[tuple[Any, ...]],
    n_workers: int,
    name: str,
    timeout: float,
) -> dict[str, Any]:
    started = time.monotonic()
    new = lb.router(config, name)  # returns once HTTP answers
    http_s = time.monotonic() - started
    snapshots_s = warm_s = None
    deadline = started + timeout
    while time.monotonic() < deadline:
        ws = await workers(http, new.url)
        live = [e for e in (w["events"] for w in ws.values()) if e["state"] == "live"]
        if len(live) == n_workers and all(e["snapshots"] for e in live):
            snapshots_s = time.monotonic() - started
            break
        await asyncio.sleep(0.01)
    while snapshots_s is not None and time.monotonic() < deadline:
        answers = [comparable(await score(http, new.url, body)) for body in probes]
        if answers == expected:
            warm_s = time.monotonic() - started
            break
        await asyncio.sleep(0.01)
    page = await metrics(http, new.url)
    applied = metric(page, "kvroute_event_apply_seconds_sum")
    rss = new.proc.rss_bytes()
    new.proc.stop()
    agreed = warm_s is not None
    # re-check the old replica did not move meanwhile (nothing is sent to the fleet)
    again = [comparable(await score(http, old.url, body)) for body in probes]
    assert again == expected, "the old replica's answers changed during the run"
    return {
        "http_s": round(http_s, 3),
        "snapshots_s": round(snapshots_s, 3) if snapshots_s is not None else None,
        "warm_s": round(warm_s, 3) if warm_s is not None else None,
        "agreed": agreed,
        "apply_seconds_total": round(applied, 4),
        "router_rss_mb": round(rss / 2**20, 1),
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    engine_args = ["--speed", "1000", "--num-blocks", str(args.num_blocks)]
    engine_args += ["--model-profile", args.profile, "--max-model-len", "4096"]
    with Loopback() as lb:
        engines = lb.engines(args.engines, *engine_args)
        bridges = lb.bridges(engines)
        config = lb.router_config(engines, bridges, policy={"expect_seconds": 0.5})
        old = lb.router(config, "router-old")
        block_tokens = 16
        target = int(args.fill * args.num_blocks * block_tokens)
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=64), timeout=aiohttp.ClientTimeout(total=120)
        ) as http:
            t0 = time.monotonic()
            filled = await asyncio.gather(
                *(fill(http, e.url, target, args.words, seed=i) for i, e in enumerate(engines))
            )
            fill_s = time.monotonic() - t0
            docs = [d for ds, _ in filled for d in ds]
            tokens = sum(t for _, t in filled)
            blocks = 0
            for b in bridges:
                _, health, _ = await post_json(http, b.http_url + "/health", method="GET")
                blocks += int(health["ranks"]["0"]["blocks"])
            # the old replica has applied everything the bridges hold
            for _ in range(500):
                ws = await workers(http, old.url)
                seqs = [w["events"]["last_sequence"] for w in ws.values()]
                bridge_seqs = []
                for b in bridges:
                    _, health, _ = await post_json(http, b.http_url + "/health", method="GET")
                    bridge_seqs.append(health["ranks"]["0"]["last_sequence"])
                if seqs == bridge_seqs:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.6)  # the old replica's expectations from nothing: none
            rng = random.Random(5)
            picks = rng.sample(docs, min(args.probes, len(docs)))
            probes = [completion_body(d) for d in picks]
            probes += [completion_body(d + " and then some more words") for d in picks[:5]]
            expected = [comparable(await score(http, old.url, body)) for body in probes]
            hits = sum(1 for e in expected if any((v or 0) > 0 for v in e[2].values()))
            runs = []
            for i in range(args.runs):
                run = await one_run(
                    lb, http, config, old, probes, expected, len(engines), f"router-new-{i}", 120
                )
                print(json.dumps(run), flush=True)
                runs.append(run)
            snap_bytes = 0.0
            snap_count = 0.0
            for b in bridges:
                page = await metrics(http, b.http_url)
                snap_bytes += metric(page, "kvroute_bridge_snapshot_bytes_sum")
                snap_count += metric(page, "kvroute_bridge_snapshot_bytes_count")
    warm = [r["warm_s"] for r in runs if r["warm_s"] is not None]
    return {
        "fleet": {
            "engines": args.engines,
            "profile": args.profile,
            "num_blocks_per_engine": args.num_blocks,
            "fill_target": args.fill,
            "prompt_tokens_sent": tokens,
            "cached_blocks_in_bridges": blocks,
            "documents": len(docs),
            "fill_seconds": round(fill_s, 2),
            "mean_snapshot_bytes": round(snap_bytes / snap_count) if snap_count else None,
        },
        "probes": len(probes),
        "probes_with_hits": hits,
        "runs": runs,
        "median_warm_s": round(statistics.median(warm), 3) if warm else None,
        "median_snapshots_s": round(statistics.median([r["snapshots_s"] for r in runs]), 3),
        "smoke": args.smoke,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=16384, help="KV blocks per engine")
    p.add_argument("--profile", default="dense")
    p.add_argument("--fill", type=float, default=0.9, help="fraction of each pool to fill")
    p.add_argument("--words", type=int, default=600, help="words per document")
    p.add_argument("--probes", type=int, default=20)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="2 small engines, 1 run: seconds")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.smoke:
        args.engines, args.num_blocks, args.runs, args.words, args.probes = 2, 1024, 1, 200, 6
    result = asyncio.run(bench(args))
    out = args.out or RESULTS / ("replicas_smoke.json" if args.smoke else "replicas.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    return 0 if all(r["agreed"] for r in result["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
