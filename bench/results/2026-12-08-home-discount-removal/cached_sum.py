"""Engine-reported cached tokens summed over a `bench.routing_seeds` run's seeds, per router.

    python cached_sum.py RUN_DIR...

Prints, per run folder, each router's cached tokens over all seeds and, for every router
after the first (`kvroute` when present), its total as a share of the first router's.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path


def totals(run: Path) -> Counter[str]:
    out: Counter[str] = Counter()
    for path in sorted(run.glob("seeds/seed*/routing_*.json")):
        for router in json.loads(path.read_text())["routers"]:
            if router.get("status", "ok") == "ok":
                out[router["name"]] += int(router["engine_cached_tokens"])
    return out


def main(argv: list[str]) -> int:
    for arg in argv:
        run = Path(arg)
        t = totals(run)
        names = sorted(t, key=lambda n: (n != "kvroute", n))  # the default first
        line = ", ".join(f"{n} {t[n]:,}" for n in names)
        ref = names[0] if names else None
        shares = ", ".join(f"{n}/{ref} {t[n] / t[ref]:.2%}" for n in names[1:] if ref and t[ref])
        print(f"{run.name}: {line}" + (f"; {shares}" if shares else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
