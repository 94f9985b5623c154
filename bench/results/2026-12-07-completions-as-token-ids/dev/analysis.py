"""The tables of this folder's README from its runs (python analysis.py, from this folder)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

HERE = Path(__file__).parent
BURST_S = 40.0  # the sample's first turns arrive in the replay's opening seconds


def q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def ms(rs: list[dict], key: str, p: float = 0.5) -> str:
    vals = [r[key] for r in rs if r.get(key) is not None]
    return f"{q(vals, p) * 1000:.0f}" if vals else "-"


def load(run: Path) -> list[dict]:
    path = run / "kvroute.records.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [r for r in map(json.loads, f) if r["status"] == 200]


print(
    "| run | requests | TTFT p50 | p90 | p99 | engine parse p50 | forward p50 | "
    "after the burst: TTFT p50 / p90, parse p50 | cached | load average |"
)
print("|---|---:|---:|---:|---:|---:|---:|---|---:|---|")
runs = [p for p in HERE.iterdir() if p.is_dir()]
for run in sorted(runs, key=lambda p: (p.name.split("-")[1], p.name)):
    rs = load(run)
    late = [r for r in rs if r["scheduled"] >= BURST_S]
    cached = sum(r["cached_tokens"] for r in rs) / max(1, sum(r["prompt_tokens"] for r in rs))
    la = " / ".join(
        line.split("load average:")[1].split(",")[0].strip()
        for line in (run / "loadavg.txt").read_text().splitlines()
    )
    print(
        f"| {run.name} | {len(rs)} | {ms(rs, 'ttft')} | {ms(rs, 'ttft', 0.9)} | "
        f"{ms(rs, 'ttft', 0.99)} | {ms(rs, 'parse_s')} | {ms(rs, 'forward_s')} | "
        f"{ms(late, 'ttft')} / {ms(late, 'ttft', 0.9)}, {ms(late, 'parse_s')} | "
        f"{cached:.1%} | {la} |"
    )
