"""TTFT of kvroute against another router on groups of requests of one routing_bench run.

Reads ``<router>.records.jsonl`` of kvroute and of the other router and the other router's
``<router>.chains.json`` (written by ``bench.chain_diagnosis``), and for three groups of
requests (the continuing ones the other router sent away from their parent's worker, every
continuing one, the first turns) prints kvroute's median (and p99) TTFT minus the other's with
the chain-clustered paired bootstrap of ``bench.chain_diagnosis.compare_by_chain``, how many of
the group's requests were faster under kvroute, and the median of each TTFT part.

    PYTHONPATH=. python bench/results/2026-12-07-tiered-offload-public-trace/paired_by_request.py \
        TRACE RUN_DIR OTHER
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.chain_diagnosis import compare_by_chain

PARTS = ("forward_s", "parse_s", "queue_s", "prefill_s")


def answered(path: Path) -> dict[str, dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return {r["id"]: r for r in rows if r["status"] == 200}


def main() -> None:
    trace, run, other = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    ours, theirs = answered(run / "kvroute.records.jsonl"), answered(run / f"{other}.records.jsonl")
    with open(run / f"{other}.chains.json", encoding="utf-8") as f:
        chains = json.load(f)
    both = ours.keys() & theirs.keys()
    continuing = {c["id"] for c in chains} & both
    groups = {
        f"continuing, {other} left the parent's worker": {
            c["id"] for c in chains if not c["followed"]
        }
        & both,
        "continuing": continuing,
        "first turns": both - continuing,
    }
    for name, ids in groups.items():
        diffs = compare_by_chain(trace, list(ours.values()), list(theirs.values()), ids)
        lower = sum(ours[i]["ttft"] < theirs[i]["ttft"] for i in ids)
        d, tail = diffs["ttft_p50"], diffs["ttft_p99"]
        shown = "-" if d is None else f"{d.diff:+.3f} s [{d.low:+.3f}, {d.high:+.3f}]"
        print(f"{name}: n={len(ids)} median TTFT, kvroute minus {other}: {shown}", end="")
        print(f"; kvroute lower in {lower}")
        if tail is not None:
            print(f"  p99: {tail.diff:+.3f} s [{tail.low:+.3f}, {tail.high:+.3f}]")
        for part in PARTS:
            a = statistics.median(ours[i][part] or 0.0 for i in ids)
            b = statistics.median(theirs[i][part] or 0.0 for i in ids)
            print(f"  {part}: kvroute {a * 1000:.0f} ms, {other} {b * 1000:.0f} ms")


if __name__ == "__main__":
    main()
