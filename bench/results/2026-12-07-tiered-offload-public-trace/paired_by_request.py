"""TTFT of kvroute against another router, request by request, for one routing_bench run.

Reads ``<router>.records.jsonl`` of the run directory and the ``<router>.chains.json`` that
``bench.chain_diagnosis`` writes for kvroute and for the other router, pairs answered
requests by id, and prints the median paired TTFT difference (kvroute minus other) with a
95% bootstrap interval for: the continuing requests the other router sent away from their
parent's worker, every continuing request, and the first turns; then the median of each
TTFT component for those groups.

    python paired_by_request.py RUN_DIR OTHER
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

PARTS = ("forward_s", "parse_s", "queue_s", "prefill_s")


def answered(path: Path) -> dict[str, dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return {r["id"]: r for r in rows if r["status"] == 200}


def interval(diffs: list[float], rounds: int = 4000) -> tuple[float, float]:
    rng = random.Random(1)
    n = len(diffs)
    meds = sorted(
        statistics.median(diffs[rng.randrange(n)] for _ in range(n)) for _ in range(rounds)
    )
    return meds[int(0.025 * rounds)], meds[int(0.975 * rounds) - 1]


def main() -> None:
    run, other = Path(sys.argv[1]), sys.argv[2]
    ours, theirs = answered(run / "kvroute.records.jsonl"), answered(run / f"{other}.records.jsonl")
    with open(run / f"{other}.chains.json", encoding="utf-8") as f:
        chains = json.load(f)
    continuing = [c["id"] for c in chains if c["id"] in ours and c["id"] in theirs]
    groups = {
        f"continuing, {other} left the parent's worker": [
            c["id"] for c in chains if not c["followed"] and c["id"] in ours and c["id"] in theirs
        ],
        "continuing": continuing,
        "first turns": [i for i in ours if i in theirs and i not in set(continuing)],
    }
    for name, ids in groups.items():
        diffs = [ours[i]["ttft"] - theirs[i]["ttft"] for i in ids]
        lo, hi = interval(diffs)
        lower = sum(d < 0 for d in diffs)
        median = statistics.median(diffs)
        print(f"{name}: n={len(ids)} median {median:+.3f} s [{lo:+.3f}, {hi:+.3f}]", end="")
        print(f", kvroute lower in {lower}")
        for part in PARTS:
            a = statistics.median(ours[i][part] or 0.0 for i in ids)
            b = statistics.median(theirs[i][part] or 0.0 for i in ids)
            print(f"  {part}: kvroute {a * 1000:.0f} ms, {other} {b * 1000:.0f} ms")


if __name__ == "__main__":
    main()
