"""Later turns that stayed on their previous turn's worker or moved, per router, and the share
of each that lost its history (the definitions of ``bench.pool_pressure``).

    cd bench/results/2026-12-07-pool-pressure-share-0.9-swa-heldout
    PYTHONPATH=../../.. python stayed_or_moved.py ROOT PROFILE
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.pool_pressure import load_runs, lost_share


def main() -> None:
    runs = load_runs(Path(sys.argv[1]), sys.argv[2])
    for router, clusters in sorted(runs.items()):
        later = [t for turns in clusters.values() for t in turns if t.later]
        stayed = [t for t in later if not t.moved]
        moved = [t for t in later if t.moved]
        print(
            f"{router}: {len(later)} later turns; stayed {len(stayed) / len(later):.1%}, "
            f"lost history {lost_share(stayed) or 0:.1%}; moved {len(moved) / len(later):.1%}, "
            f"lost history {lost_share(moved) or 0:.1%}"
        )


if __name__ == "__main__":
    main()
