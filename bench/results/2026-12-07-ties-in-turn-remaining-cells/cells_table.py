"""One Markdown row per cell folder: cached tokens, share of the oracle, TTFT, differences.

    python cells_table.py agent/agent-dense-12 agent/agent-mamba-12 ...

Reads each folder's ``routing_<profile>.json`` (the benchmark's own summary; cached tokens
as the engines reported them) and the ``kvroute minus smg-cache-aware`` lines of its
``chain_diagnosis.txt`` (TTFT p50 and p99 differences with paired cluster-bootstrap
intervals over chains).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _cached(run: dict[str, Any]) -> float:
    return float(run["engine_cached_tokens"]) / float(run["engine_prompt_tokens"])


def _row(cell: Path) -> str:
    summary = json.loads(next(cell.glob("routing_*.json")).read_text())
    runs = {r["name"]: {**r["summary"], **r} for r in summary["routers"]}
    kv, smg = runs["kvroute"], runs["smg-cache-aware"]
    oracle = runs.get("oracle")
    share = "-"
    if oracle is not None:
        share = f"{kv['engine_cached_tokens'] / oracle['engine_cached_tokens']:.1%}"
    diffs = [
        line.split(": ", 1)[1]
        for line in (cell / "chain_diagnosis.txt").read_text().splitlines()
        if line.startswith("kvroute minus smg-cache-aware")
    ]
    return (
        f"| {cell.name} | {_cached(kv):.1%} / {_cached(smg):.1%} | {share} "
        f"| {kv['ttft_p50']:.3f} / {smg['ttft_p50']:.3f} | {kv['ttft_p99']:.3f} / "
        f"{smg['ttft_p99']:.3f} | {' | '.join(diffs)} |"
    )


def main(argv: list[str]) -> int:
    print(
        "| cell | cached kvroute / smg | kvroute / oracle | TTFT p50 kvroute / smg (s) "
        "| p99 kvroute / smg (s) | p50 kvroute minus smg | p99 kvroute minus smg |"
    )
    print("|---|---:|---:|---|---|---|---|")
    for arg in argv:
        print(_row(Path(arg)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
