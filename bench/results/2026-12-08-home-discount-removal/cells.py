"""One Markdown row per router of each re-run public cell: cached tokens, share of the
oracle's (the oracle run of the same cell in the earlier folder), TTFT differences to smg.

    python cells.py agent/agent-mamba-3 agent/agent-dense-3 agent/agent-swa-3

Reads each folder's ``routing_<profile>.json`` (cached tokens as the engines reported them)
and the ``minus smg-cache-aware`` lines of its ``chain_diagnosis-<router>.txt`` (paired
cluster-bootstrap intervals over chains).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

EARLIER = Path(__file__).parent / "../2026-12-07-ties-in-turn-remaining-cells"


def _summary(folder: Path) -> dict[str, dict[str, int]]:
    data = json.loads(next(folder.glob("routing_*.json")).read_text())
    return {r["name"]: r for r in data["routers"]}


def _diffs(path: Path) -> str:
    out = []
    for line in path.read_text().splitlines():
        if "minus smg-cache-aware" in line:
            # "<router> minus smg-cache-aware, ttft_p50: -10.933 s [-16.160, -3.516] lower"
            out.append(line.split(": ", 1)[1].rsplit(" ", 1)[0])
    return "; ".join(out)


def main(argv: list[str]) -> int:
    print(
        "| cell | router | cached tokens (% of the engines' prompt tokens) | of the oracle's "
        "| TTFT p50, p99 minus smg's |"
    )
    print("|---|---|---|---|---|")
    for arg in argv:
        cell = Path(arg)
        runs = _summary(cell)
        oracle = _summary(EARLIER / cell.parent.name / cell.name).get("oracle")
        for name in ("kvroute", "kvroute-no-home", "smg-cache-aware"):
            r = runs[name]
            cached = r["engine_cached_tokens"] / r["engine_prompt_tokens"]
            share = (
                f"{r['engine_cached_tokens'] / oracle['engine_cached_tokens']:.1%}"
                if oracle
                else "-"
            )
            diag = cell / f"chain_diagnosis-{name}.txt"
            diffs = _diffs(diag) if diag.exists() else ""
            tokens = f"{r['engine_cached_tokens']:,} ({cached:.1%})"
            print(f"| {cell.name} | {name} | {tokens} | {share} | {diffs} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
