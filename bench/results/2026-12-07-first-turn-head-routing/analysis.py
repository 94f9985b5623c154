"""The tables of this folder's README from its runs (python analysis.py, from this folder)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

HERE = Path(__file__).parent


def q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def ms(rs: list[dict], key: str, p: float) -> int:
    return round(q([r[key] for r in rs if r.get(key) is not None], p) * 1000)


def heads(name: str) -> str:
    m = {}
    for line in (HERE / "runs" / f"{name}.metrics.txt").read_text().splitlines():
        k, v = line.rsplit(" ", 1)
        m[k] = float(v)
    routed = m.get('kvroute_prompt_heads_total{outcome="routed"}')
    done = m.get('kvroute_prompt_heads_total{outcome="completed"}')
    before = m.get('kvroute_tokenize_seconds_sum{mode="local"}', 0.0)
    counts = "" if routed is None or done is None else f"{int(routed)} / {int(done)}"
    return f"{before:5.1f} s | {counts}"


COLUMNS = [
    "run",
    "TTFT p50",
    "TTFT p90",
    "forward p50",
    "burst (< 40 s): TTFT p50, forward p50 / p90",
    "after: TTFT p50 / p90, forward p50",
    "cached",
    "tokenizing before dispatch (sum)",
    "heads routed / completed",
]
print("| " + " | ".join(COLUMNS) + " |")
print("|---|---|---|---|---|---|---|---|---|")
for name in sorted(p.name.split(".")[0] for p in (HERE / "runs").glob("*.records.jsonl.gz")):
    with gzip.open(HERE / "runs" / f"{name}.records.jsonl.gz", "rt") as f:
        rs = [r for r in map(json.loads, f) if r["status"] == 200]
    early = [r for r in rs if r["scheduled"] < 40]
    late = [r for r in rs if r["scheduled"] >= 40]
    cached = sum(r["cached_tokens"] or 0 for r in rs) / sum(r["prompt_tokens"] for r in rs)
    print(
        f"| {name} | {ms(rs, 'ttft', 0.5)} | {ms(rs, 'ttft', 0.9)} | {ms(rs, 'forward_s', 0.5)} "
        f"| {ms(early, 'ttft', 0.5)}, {ms(early, 'forward_s', 0.5)} / "
        f"{ms(early, 'forward_s', 0.9)} "
        f"| {ms(late, 'ttft', 0.5)} / {ms(late, 'ttft', 0.9)}, {ms(late, 'forward_s', 0.5)} "
        f"| {cached * 100:.1f}% | {heads(name)} |"
    )
