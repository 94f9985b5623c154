"""Decisions the home discount turned, read from recorded decisions.

    python home_removed.py RUN_DIR/kvroute.decisions.jsonl.gz ...

For each decision the TTFT policy made by cost (reasons `cache` and `affinity`, and `spill`
among the unsaturated workers), the cheapest worker is found again with the home's running
requests charged as every other worker's (`policy.tokens_per_running`, 100 tokens, instead
of `policy.tokens_per_running_home`, 20, and no `home_bound`). A decision is "turned" when
that moves the cheapest worker. Like `../2026-12-07-ties-in-turn-remaining-cells/
terms_changed.py`, a counterfactual at decision time only; costs are recorded to the
microsecond, so a counterfactual cheapest within 2 us of the base one counts as a tie, apart.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

RUNNING, RUNNING_HOME = 100.0, 20.0  # the defaults at the recorded runs
TIE_S = 2e-6


def _cost(c: dict[str, Any], without_home: bool) -> float:
    total = float(c["cost_s"])
    if without_home:
        home = float(c["terms"].get("home", 0.0))
        total += home * (RUNNING / RUNNING_HOME - 1.0) - float(c["terms"].get("home_bound", 0.0))
    return total


def _cheapest(cands: list[dict[str, Any]], without_home: bool) -> tuple[str, float]:
    costs = sorted((_cost(c, without_home), c["worker"]) for c in cands)
    gap = costs[1][0] - costs[0][0] if len(costs) > 1 else float("inf")
    return costs[0][1], gap


def count(path: Path) -> Counter[str]:
    out: Counter[str] = Counter()
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        for line in lines:
            d = json.loads(line)
            out["decisions"] += 1
            cands = [c for c in d.get("candidates") or [] if "terms" in c]
            if d["reason"] == "spill":
                cands = [c for c in cands if not c["saturated"]]
            elif d["reason"] not in ("cache", "affinity"):
                continue
            if len(cands) < 2:
                continue
            out["by cost"] += 1
            if any(float(c["terms"].get("home", 0.0)) > 0 for c in cands):
                out["home charged"] += 1
            if any(float(c["terms"].get("home_bound", 0.0)) > 0 for c in cands):
                out["bound engaged"] += 1
            base, _ = _cheapest(cands, False)
            alt, gap = _cheapest(cands, True)
            if alt != base:
                out["turned (within 2 us: tie)" if gap <= TIE_S else "turned"] += 1
    return out


def main(argv: list[str]) -> int:
    total: Counter[str] = Counter()
    for arg in argv:
        path = Path(arg)
        n = count(path)
        total += n
        name = path.parent.name
        if name.startswith("routing_"):  # a generator seed: seeds/seedN/runs/routing_P
            name = f"{path.parents[2].name}/{name}"
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in n.items()))
    print("all: " + ", ".join(f"{k} {v}" for k, v in total.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
