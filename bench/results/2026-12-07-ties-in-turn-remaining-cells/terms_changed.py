"""How many of kvroute's decisions each cost term turned, read from recorded decisions.

    python terms_changed.py agent/*/kvroute.decisions.jsonl.gz conversation/*/...

For every decision the TTFT policy made by comparing costs, the chosen worker is compared
with the cheapest worker once one term is left out of every candidate's cost (each term in
turn). A term "turned" a decision when leaving it out changes the cheapest worker. This is a
counterfactual at decision time only: it does not replay what the other choice would have done
to later requests, so it says which terms act on a trace, not what they are worth.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any


def _cheapest(candidates: list[dict[str, Any]], without: str | None) -> str:
    def cost(c: dict[str, Any]) -> float:
        total = float(c["cost_s"])
        if without is not None:
            total -= float(c["terms"].get(without, 0.0))
        return total

    return min(candidates, key=lambda c: (cost(c), c["worker"]))["worker"]


def count(path: Path) -> tuple[int, Counter[str], Counter[str]]:
    """Decisions compared by cost, decisions each term turned, and decisions by reason."""
    compared = 0
    turned: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        for line in lines:
            decision = json.loads(line)
            reasons[decision["reason"]] += 1
            candidates = [c for c in decision.get("candidates") or [] if "terms" in c]
            if len(candidates) < 2 or decision["reason"] != "cache":
                continue
            compared += 1
            base = _cheapest(candidates, None)
            if decision["chosen"] != base:
                turned["(chosen is not the cheapest: ties, spill)"] += 1
            for term in candidates[0]["terms"]:
                if _cheapest(candidates, term) != base:
                    turned[term] += 1
    return compared, turned, reasons


def main(argv: list[str]) -> int:
    for arg in argv:
        path = Path(arg)
        compared, turned, reasons = count(path)
        shares = ", ".join(f"{t} {n}" for t, n in turned.most_common()) or "none"
        print(f"{path.parent.name}: {sum(reasons.values())} decisions ({dict(reasons)})")
        print(f"  by cost: {compared}; turned by leaving out: {shares}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
