"""Report of the pool-pressure benchmark: do returning turns still find their cache?

Reads the per-request records that ``bench.routing_seeds --workload pool-pressure`` left for
each seed and router (``<root>/seeds/seed<k>/runs/routing_<profile>/<router>.records.jsonl``)
and reports per router, over every seed pooled:

- **later-turn hit rate**: engine-reported cached tokens over prompt tokens, summed over the
  answered turns after a conversation's first;
- **TTFT p50 / p90 / p99** over every answered request;
- **lost history**: the share of later turns whose cached tokens fell short of the previous
  turn's prompt by more than one block (the previous turn left that prompt in an engine's
  cache: it was evicted since, or the turn went elsewhere);

each with a 95% cluster-bootstrap interval (a conversation of a seed is one cluster, resampled
whole), and against a reference router (default kvroute) the paired difference of each with
its interval, "lower"/"higher" only when the interval excludes zero.

    python -m bench.pool_pressure --root OUT --profile dense [--reference kvroute]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.report import markdown_table
from kvroute.testbed.stats import percentile, read_records

BLOCK_TOKENS = 16
LEVEL = 0.95


@dataclass(frozen=True, slots=True)
class Turn:
    """One answered request, as the metrics need it."""

    ttft: float
    prompt: int
    cached: int
    later: bool  # a turn after its conversation's first
    lost: bool  # a later turn that lost its history
    moved: bool = False  # a later turn sent to another worker than its previous turn


Cluster = list[Turn]  # one conversation of one seed
Stat = Callable[[Sequence[Turn]], float | None]


def conversations(records: Sequence[dict[str, Any]]) -> dict[str, Cluster]:
    """The answered turns of each conversation, in turn order (``turn`` when recorded, else
    send time). A turn counts as later when an earlier turn of its conversation was answered;
    it lost its history when it found fewer cached tokens than that previous prompt's tokens
    minus one block, and moved when it went to another worker than that previous turn."""
    by_session: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("status") == 200 and r.get("error") is None and r.get("ttft") is not None:
            by_session.setdefault(str(r.get("session") or r.get("id")), []).append(r)
    out: dict[str, Cluster] = {}
    for session, rs in by_session.items():
        rs.sort(key=lambda r: (r.get("turn") if r.get("turn") is not None else -1, r["sent"]))
        turns: Cluster = []
        prev_prompt: int | None = None
        prev_worker: str | None = None
        for r in rs:
            prompt, cached = int(r.get("prompt_tokens") or 0), int(r.get("cached_tokens") or 0)
            later = prev_prompt is not None
            lost = later and cached < (prev_prompt or 0) - BLOCK_TOKENS
            moved = later and r.get("worker") != prev_worker
            turns.append(Turn(float(r["ttft"]), prompt, cached, later, lost, moved))
            prev_prompt, prev_worker = prompt, r.get("worker")
        out[session] = turns
    return out


def later_hit_rate(turns: Sequence[Turn]) -> float | None:
    """Cached over prompt tokens, summed over later turns."""
    prompt = sum(t.prompt for t in turns if t.later)
    return sum(t.cached for t in turns if t.later) / prompt if prompt else None


def lost_share(turns: Sequence[Turn]) -> float | None:
    """Later turns that lost their history, as a share of later turns."""
    later = [t for t in turns if t.later]
    return sum(t.lost for t in later) / len(later) if later else None


def ttft_pct(q: float) -> Stat:
    def stat(turns: Sequence[Turn]) -> float | None:
        return percentile([t.ttft for t in turns], q)

    return stat


METRICS: dict[str, Stat] = {
    "later_hit_rate": later_hit_rate,
    "ttft_p50_s": ttft_pct(50),
    "ttft_p90_s": ttft_pct(90),
    "ttft_p99_s": ttft_pct(99),
    "lost_history": lost_share,
}


def _bounds(draws: list[float]) -> tuple[float | None, float | None]:
    if not draws:
        return None, None
    draws.sort()
    tail = (1.0 - LEVEL) / 2 * 100
    return percentile(draws, tail), percentile(draws, 100 - tail)


def interval(
    clusters: Sequence[Cluster], stat: Stat, iterations: int = 1000, seed: int = 0
) -> dict[str, float | None]:
    """``stat`` over every cluster's turns, with a seeded cluster-bootstrap interval."""
    value = stat([t for c in clusters for t in c])
    rng = random.Random(seed)
    draws = []
    for _ in range(iterations if clusters else 0):
        x = stat([t for c in rng.choices(clusters, k=len(clusters)) for t in c])
        if x is not None:
            draws.append(x)
    low, high = _bounds(draws)
    return {"value": value, "low": low, "high": high}


def paired_interval(
    pairs: Sequence[tuple[Cluster, Cluster]], stat: Stat, iterations: int = 1000, seed: int = 0
) -> dict[str, Any]:
    """``stat`` of the first router's turns minus the second's, pooled over the pairs (the same
    conversation as each served it), with a paired cluster-bootstrap interval and a verdict."""

    def diff(sample: Sequence[tuple[Cluster, Cluster]]) -> float | None:
        a = stat([t for x, _ in sample for t in x])
        b = stat([t for _, y in sample for t in y])
        return None if a is None or b is None else a - b

    value = diff(pairs)
    rng = random.Random(seed)
    draws = []
    for _ in range(iterations if pairs else 0):
        d = diff(rng.choices(pairs, k=len(pairs)))
        if d is not None:
            draws.append(d)
    low, high = _bounds(draws)
    verdict = "not distinguishable"
    if high is not None and high < 0:
        verdict = "lower"
    elif low is not None and low > 0:
        verdict = "higher"
    return {"diff": value, "low": low, "high": high, "verdict": verdict}


def load_runs(root: Path, profile: str) -> dict[str, dict[tuple[int, str], Cluster]]:
    """Per router: (seed, conversation) -> its answered turns, over every seed under root."""
    out: dict[str, dict[tuple[int, str], Cluster]] = {}
    for seed_dir in sorted(root.glob("seeds/seed*")):
        seed = int(seed_dir.name.removeprefix("seed"))
        run_dir = seed_dir / "runs" / f"routing_{profile}"
        names = {p.name.split(".records.jsonl")[0] for p in run_dir.glob("*.records.jsonl*")}
        for name in sorted(names):
            convs = conversations(read_records(run_dir / f"{name}.records.jsonl"))
            clusters = out.setdefault(name, {})
            for session, turns in convs.items():
                clusters[(seed, session)] = turns
    return out


def report(
    runs: dict[str, dict[tuple[int, str], Cluster]], reference: str | None, iterations: int = 1000
) -> dict[str, Any]:
    """Each router's metrics with intervals, and the reference's paired differences."""
    routers: dict[str, Any] = {}
    for name, clusters in runs.items():
        cs = list(clusters.values())
        routers[name] = {
            "seeds": sorted({s for s, _ in clusters}),
            "requests": sum(len(c) for c in cs),
            "later_turns": sum(t.later for c in cs for t in c),
            **{m: interval(cs, stat, iterations) for m, stat in METRICS.items()},
        }
    paired: dict[str, Any] = {}
    if reference in runs:
        ref = runs[reference]
        for name, clusters in runs.items():
            if name == reference:
                continue
            keys = sorted(set(ref) & set(clusters))
            pairs = [(ref[k], clusters[k]) for k in keys]
            paired[name] = {m: paired_interval(pairs, s, iterations) for m, s in METRICS.items()}
    return {"reference": reference, "level": LEVEL, "routers": routers, "paired": paired}


def _ci(m: dict[str, Any], fmt: str, scale: float = 1.0) -> str:
    if m.get("value") is None:
        return "-"
    lo, hi = m.get("low"), m.get("high")
    bounds = "" if lo is None or hi is None else f" [{lo * scale:{fmt}}, {hi * scale:{fmt}}]"
    return f"{m['value'] * scale:{fmt}}{bounds}"


def _diff(d: dict[str, Any], fmt: str) -> str:
    if d.get("diff") is None:
        return "-"
    return f"{d['diff']:+{fmt}} [{d['low']:+{fmt}}, {d['high']:+{fmt}}]: {d['verdict']}"


def markdown(result: dict[str, Any], labels: dict[str, str] | None = None) -> str:
    """The two tables: each router's metrics, and the reference against each other router."""
    labels = labels or {}
    rows = [
        [
            labels.get(name, name),
            str(r["requests"]),
            _ci(r["later_hit_rate"], ".3f"),
            _ci(r["ttft_p50_s"], ".2f"),
            _ci(r["ttft_p90_s"], ".2f"),
            _ci(r["ttft_p99_s"], ".2f"),
            _ci(r["lost_history"], ".1f", 100.0),
        ]
        for name, r in result["routers"].items()
    ]
    head = ["router", "requests", "later-turn hit rate", "TTFT p50 (s)", "p90 (s)", "p99 (s)"]
    lines = [markdown_table([*head, "lost history (%)"], rows), ""]
    if result["paired"]:
        ref = labels.get(result["reference"], result["reference"])
        lines += [
            f"{ref} minus each other router, paired over the same conversations:",
            "",
            markdown_table(
                ["other router", "later-turn hit rate", "TTFT p90 (s)", "TTFT p99 (s)", "lost"],
                [
                    [
                        labels.get(name, name),
                        _diff(d["later_hit_rate"], ".3f"),
                        _diff(d["ttft_p90_s"], ".2f"),
                        _diff(d["ttft_p99_s"], ".2f"),
                        _diff(d["lost_history"], ".3f"),
                    ]
                    for name, d in result["paired"].items()
                ],
            ),
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pool_pressure", description=__doc__)
    p.add_argument("--root", required=True, help="the routing_seeds output directory")
    p.add_argument("--profile", required=True, help="dense, swa, ...")
    p.add_argument("--reference", default="kvroute", help="router the differences are against")
    p.add_argument("--iterations", type=int, default=1000, help="bootstrap resamples")
    args = p.parse_args(argv)
    root = Path(args.root)
    runs = load_runs(root, args.profile)
    if not runs:
        raise SystemExit(f"no records under {root}/seeds/seed*/runs/routing_{args.profile}")
    result = report(runs, args.reference, args.iterations)
    result["profile"] = args.profile
    stem = root / f"pool_pressure_{args.profile}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    stem.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
