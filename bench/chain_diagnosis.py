"""Why a routed conversation left its cache: a request-by-request diagnosis of a trace replay.

Reads one router's run of ``bench.routing_bench`` on a Mooncake-format trace (its
``<router>.records.jsonl`` and, for kvroute, ``<router>.decisions.jsonl``) and the trace
itself. For every request that continues an earlier one of its chain (see
``kvroute/testbed/trace_chains.py``) it asks: did it go to the worker its parent went to;
if not, what kvroute predicted on the parent's worker and on the chosen one, which reason
and which cost terms moved it, and how many of the prompt tokens shared with the parent the
engine did not find cached (what leaving cost).

    python -m bench.chain_diagnosis --trace sample.jsonl --run-dir RUN_DIR --router kvroute

prints a summary table (Markdown) and writes ``<router>.chains.json`` with one row per
continuing request next to the run's files.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvroute.testbed.stats import Difference, paired_bootstrap
from kvroute.testbed.trace import MOONCAKE_BLOCK_TOKENS, read_mooncake
from kvroute.testbed.trace_chains import link_chains

# how far out of send order a request may reach the router: a burst of the trace's requests
# sent at once reached it up to 20 places out of order in a replay on 2 cores
_REORDER_WINDOW = 64


@dataclass(frozen=True, slots=True)
class Continuation:
    """One request that extends an earlier request of its chain, and what routing did."""

    id: str
    parent_id: str
    shared_tokens: int  # prompt tokens equal to the parent's (block prefix)
    parent_worker: str | None
    worker: str | None
    followed: bool
    reason: str | None
    cached_tokens: int
    lost_tokens: int  # shared with the parent but not found cached by the engine
    predicted_on_parent: int | None
    predicted_on_chosen: int | None
    cost_on_parent_s: float | None
    cost_on_chosen_s: float | None
    # per term: value on the parent's worker minus value on the chosen one (seconds)
    term_gap_s: dict[str, float]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as src:
        return [json.loads(line) for line in src if line.strip()]


def _align_decisions(
    records: Sequence[dict[str, Any]], decisions: Sequence[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Pair decisions (in arrival order) with records (in send order): requests sent within
    moments of each other can reach the router in either order, so each decision takes the
    earliest unpaired record of its prompt length among the next few sent."""
    pending = sorted((r for r in records if r.get("sent") is not None), key=lambda r: r["sent"])
    out: dict[str, dict[str, Any]] = {}
    for dec in sorted(decisions, key=lambda d: d["id"]):
        for j, rec in enumerate(pending[:_REORDER_WINDOW]):
            if rec.get("prompt_tokens") in (None, dec.get("prompt_tokens")):
                out[rec["id"]] = dec
                del pending[j]
                break
        else:
            raise ValueError(f"decision {dec['id']} does not match any request sent near it")
    return out


def _candidate(dec: dict[str, Any] | None, worker: str | None) -> dict[str, Any] | None:
    if dec is None or worker is None:
        return None
    for c in dec.get("candidates", []):
        if c["worker"] == worker:
            return dict(c)
    return None


def diagnose(
    trace: Path, records: Sequence[dict[str, Any]], decisions: Sequence[dict[str, Any]] | None
) -> list[Continuation]:
    """One row per request of the trace that has a parent in its chain."""
    recs = list(read_mooncake(trace))
    links = link_chains([r.hash_ids for r in recs])
    by_id = {r["id"]: r for r in records}
    decided = _align_decisions(records, decisions) if decisions else {}
    rows: list[Continuation] = []
    for i, parent in enumerate(links.parent):
        rid, pid = f"mc-{i:06d}", f"mc-{parent:06d}" if parent is not None else ""
        if parent is None or rid not in by_id or pid not in by_id:
            continue
        rec, prec = by_id[rid], by_id[pid]
        if rec.get("status") != 200 or prec.get("status") != 200:
            continue
        shared = min(links.shared_blocks[i] * MOONCAKE_BLOCK_TOKENS, recs[i].input_length)
        dec = decided.get(rid)
        on_parent = _candidate(dec, prec["worker"])
        on_chosen = _candidate(dec, rec["worker"])
        gaps: dict[str, float] = {}
        if on_parent and on_chosen:
            for name, value in (on_parent.get("terms") or {}).items():
                gaps[name] = round(value - (on_chosen.get("terms") or {}).get(name, 0.0), 6)
        cached = int(rec.get("cached_tokens") or 0)
        rows.append(
            Continuation(
                id=rid,
                parent_id=pid,
                shared_tokens=shared,
                parent_worker=prec["worker"],
                worker=rec["worker"],
                followed=rec["worker"] == prec["worker"],
                reason=dec.get("reason") if dec else None,
                cached_tokens=cached,
                lost_tokens=max(0, shared - cached),
                predicted_on_parent=on_parent.get("predicted_reuse") if on_parent else None,
                predicted_on_chosen=on_chosen.get("predicted_reuse") if on_chosen else None,
                cost_on_parent_s=on_parent.get("cost_s", on_parent.get("est_ttft_s"))
                if on_parent
                else None,
                cost_on_chosen_s=on_chosen.get("cost_s", on_chosen.get("est_ttft_s"))
                if on_chosen
                else None,
                term_gap_s=gaps,
            )
        )
    return rows


def summarize(rows: Sequence[Continuation]) -> str:
    """A Markdown table: continuations by (followed, reason, did the index know), tokens lost."""
    groups: dict[tuple[str, str, str], list[Continuation]] = defaultdict(list)
    for r in rows:
        knew = (
            "unknown"
            if r.predicted_on_parent is None
            else (
                "index held it"
                if r.predicted_on_parent >= r.shared_tokens // 2
                else "index lost it"
            )
        )
        groups[("stayed" if r.followed else "left", r.reason or "-", knew)].append(r)
    lines = [
        "| parent's worker | reason | on the parent's worker | requests | shared tokens "
        "| lost tokens | largest term gap (median s) |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for key in sorted(groups, key=lambda k: -sum(r.lost_tokens for r in groups[k])):
        members = groups[key]
        gaps: dict[str, list[float]] = defaultdict(list)
        for r in members:
            for name, g in r.term_gap_s.items():
                gaps[name].append(g)
        medians = {n: sorted(v)[len(v) // 2] for n, v in gaps.items()}
        top = max(medians.items(), key=lambda kv: kv[1], default=None)
        top_s = f"{top[0]} {top[1]:+.3f}" if top else "-"
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {len(members)} "
            f"| {sum(r.shared_tokens for r in members):,} "
            f"| {sum(r.lost_tokens for r in members):,} | {top_s} |"
        )
    total_shared = sum(r.shared_tokens for r in rows)
    total_lost = sum(r.lost_tokens for r in rows)
    lines.append(
        f"\n{len(rows)} continuing requests; {total_lost:,} of {total_shared:,} tokens shared "
        f"with the parent not found cached ({total_lost / max(1, total_shared):.1%})."
    )
    return "\n".join(lines)


def compare_by_chain(
    trace: Path,
    first: Sequence[dict[str, Any]],
    second: Sequence[dict[str, Any]],
    ids: Collection[str] | None = None,
) -> dict[str, Difference | None]:
    """TTFT p50 and p99 of the first router's replay minus the second's, with paired
    cluster-bootstrap intervals whose clusters are the trace's chains (a conversation's
    requests are correlated, so whole chains are resampled, the same ones for both).
    With `ids`, only those requests count (on both sides)."""
    chain = link_chains([r.hash_ids for r in read_mooncake(trace)]).chain

    def by_chain(records: Sequence[dict[str, Any]]) -> dict[int, list[float]]:
        out: dict[int, list[float]] = defaultdict(list)
        for r in records:
            if ids is not None and r["id"] not in ids:
                continue
            if r.get("status") == 200 and r.get("ttft") is not None:
                out[chain[int(r["id"].removeprefix("mc-"))]].append(float(r["ttft"]))
        return out

    a, b = by_chain(first), by_chain(second)
    clusters = [(a.get(k, []), b.get(k, [])) for k in sorted(a.keys() | b.keys())]
    return {f"ttft_p{q:g}": paired_bootstrap(clusters, q) for q in (50.0, 99.0)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chain_diagnosis", description=__doc__)
    p.add_argument("--trace", required=True, help="the Mooncake-format trace that was replayed")
    p.add_argument("--run-dir", required=True, help="the run folder (holds <router>.records.jsonl)")
    p.add_argument("--router", default="kvroute", help="router name of the run files")
    p.add_argument(
        "--against", default=None, help="also compare TTFT with this router's run, by chain"
    )
    args = p.parse_args(argv)
    run = Path(args.run_dir)
    records = _read_jsonl(run / f"{args.router}.records.jsonl")
    dec_path = run / f"{args.router}.decisions.jsonl"
    decisions = _read_jsonl(dec_path) if dec_path.exists() else None
    rows = diagnose(Path(args.trace), records, decisions)
    with open(run / f"{args.router}.chains.json", "w", encoding="utf-8") as out:
        json.dump([asdict(r) for r in rows], out, indent=1)
    print(summarize(rows))
    if args.against:
        other = _read_jsonl(run / f"{args.against}.records.jsonl")
        for name, d in compare_by_chain(Path(args.trace), records, other).items():
            shown = (
                "-" if d is None else f"{d.diff:+.3f} s [{d.low:+.3f}, {d.high:+.3f}] {d.verdict}"
            )
            print(f"{args.router} minus {args.against}, {name}: {shown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
