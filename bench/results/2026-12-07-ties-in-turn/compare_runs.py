"""kvroute's TTFT in one routing_bench run minus kvroute's in another, on the same trace.

For A/B runs of two router versions made one after the other (each its own routing_bench
run): prints, per run, the engines' cached share and requests per engine, and the first
run's TTFT p50 and p99 minus the second's, paired over the trace's chains with the cluster
bootstrap of ``bench.chain_diagnosis.compare_by_chain``.

    PYTHONPATH=. python bench/results/2026-12-07-ties-in-turn/compare_runs.py \
        TRACE RUN_A RUN_B [PROFILE]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.chain_diagnosis import compare_by_chain


def _records(run: Path, profile: str) -> list[dict[str, Any]]:
    path = run / "runs" / f"routing_{profile}" / "kvroute.records.jsonl"
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _summary(run: Path, profile: str) -> str:
    result = json.loads((run / f"routing_{profile}.json").read_text())
    row = next(r for r in result["routers"] if r["name"] == "kvroute")
    share = row["engine_cached_tokens"] / row["engine_prompt_tokens"]
    return f"cached {share:.1%}, requests per engine {row['per_engine_requests']}"


def main() -> None:
    trace, a, b = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    profile = sys.argv[4] if len(sys.argv) > 4 else "dense"
    print(f"{a.name}: {_summary(a, profile)}")
    print(f"{b.name}: {_summary(b, profile)}")
    diffs = compare_by_chain(trace, _records(a, profile), _records(b, profile))
    for name, d in diffs.items():
        shown = "-" if d is None else f"{d.diff:+.3f} s [{d.low:+.3f}, {d.high:+.3f}]"
        print(f"{a.name} minus {b.name}, {name}: {shown}")


if __name__ == "__main__":
    main()
