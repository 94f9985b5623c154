"""Where a later turn's history went, for one kvroute run of the pool-pressure benchmark.

Reads ``<router>.records.jsonl`` and ``<router>.decisions.jsonl`` of one run directory
(records sorted by send time line up with the decisions, as ``bench.routing_bench`` writes
them) and sorts every answered turn after a conversation's first by:

- whether it went to the worker of its previous turn (stayed) or elsewhere (moved),
- whether the router's index, at routing time, still showed at least half of the previous
  turn's prompt on that previous worker (held) or not (gone),
- whether the engine then found the previous prompt (kept: cached tokens within a block of
  it) or not (lost),

and, for the turns that stayed where the index showed their history, the median time the
engine queued them (a prompt's blocks are not pinned while it waits, so prefills admitted
ahead of it can evict them).

    python where_history_went.py RUN_DIR [ROUTER ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

BLOCK_TOKENS = 16


def _lines(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def classify(run_dir: Path, router: str) -> tuple[Counter[str], dict[str, list[float]]]:
    """Counts of (stayed|moved, held|gone, kept|lost) and engine queue times by outcome."""
    records = sorted(_lines(run_dir / f"{router}.records.jsonl"), key=lambda r: r["sent"])
    decisions = _lines(run_dir / f"{router}.decisions.jsonl")
    if len(records) != len(decisions):
        raise SystemExit(f"{router}: {len(records)} records but {len(decisions)} decisions")
    decision_of = {r["id"]: d for r, d in zip(records, decisions, strict=True)}
    previous: dict[str, dict[str, Any]] = {}
    counts: Counter[str] = Counter()
    queued: dict[str, list[float]] = {"kept": [], "lost": []}
    for r in sorted(records, key=lambda r: (r["session"], r["turn"])):
        prev = previous.get(r["session"])
        previous[r["session"]] = r
        if prev is None or r["status"] != 200 or prev["prompt_tokens"] is None:
            continue
        shown = {c["worker"]: c["predicted_reuse"] or 0 for c in decision_of[r["id"]]["candidates"]}
        held = shown.get(prev["worker"], 0) >= prev["prompt_tokens"] / 2
        stayed = r["worker"] == prev["worker"]
        kept = r["cached_tokens"] >= prev["prompt_tokens"] - BLOCK_TOKENS
        outcome = "kept" if kept else "lost"
        counts[f"{'stayed' if stayed else 'moved'}/{'held' if held else 'gone'}/{outcome}"] += 1
        if stayed and held:
            queued[outcome].append(r["queue_s"] or 0.0)
    return counts, queued


def main(argv: list[str]) -> None:
    run_dir = Path(argv[0])
    for router in argv[1:] or ["kvroute"]:
        counts, queued = classify(run_dir, router)
        total = sum(counts.values())
        print(f"{router}: {total} later turns")
        for key, n in sorted(counts.items()):
            print(f"  {key:<20} {n:5d}  {n / total:6.1%}")
        for outcome, times in queued.items():
            if times:
                median = statistics.median(times)
                print(f"  stayed/held/{outcome}: median engine queue {median:.2f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
