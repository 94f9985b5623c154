"""Paired chain-cluster bootstrap of the public-trace replay's TTFT (kvroute minus another).

    python bench/results/2026-12-06-pd-decode-choice/public_trace_ttft.py \
        conversation-heldout.jsonl public-trace/runs/routing_dense_pd OTHER_ROUTER

A chain (`kvroute/testbed/trace_chains.py`) is resampled whole, the same chains for both.
Records are the bench's per-request files (`mc-<index in the trace>`); failed requests are left
out of both sides' percentiles.
"""

import sys
from pathlib import Path

from kvroute.testbed.stats import paired_bootstrap, read_records
from kvroute.testbed.trace import read_mooncake
from kvroute.testbed.trace_chains import link_chains


def ttfts(path: Path) -> dict[int, float]:
    out = {}
    for r in read_records(path):
        if r.get("status") == 200 and r.get("ttft") is not None:
            out[int(str(r["id"]).split("-")[1])] = float(r["ttft"])
    return out


def main(trace: Path, run_dir: Path, other: str) -> None:
    chain = link_chains([rec.hash_ids for rec in read_mooncake(trace)]).chain
    a, b = ttfts(run_dir / "kvroute.records.jsonl"), ttfts(run_dir / f"{other}.records.jsonl")
    clusters: dict[int, tuple[list[float], list[float]]] = {}
    for i, c in enumerate(chain):
        pair = clusters.setdefault(c, ([], []))
        if i in a:
            pair[0].append(a[i])
        if i in b:
            pair[1].append(b[i])
    for q in (50, 90, 99):
        d = paired_bootstrap(list(clusters.values()), q)
        if d is not None:
            print(f"p{q}: {d}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
