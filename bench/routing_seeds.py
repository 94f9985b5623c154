"""Benchmark 1 over several seeds: do the TTFT differences between routers outlast one run?

One run of the default trace has about 300 requests: its p99 is about its third-slowest
request, and two runs of one router differ by more than the gaps between the good routers.
This runs :mod:`bench.routing_bench` once per seed (each seed generates another trace: other
sessions, prompts and arrival times), every router on a fresh fleet within a seed, and reports
per router:

- the median over seeds (and the range) of cached tokens and of TTFT p50 and p99,
- TTFT percentiles pooled over every request of every seed (about 300 x seeds requests, so
  the pooled p99 rests on a few dozen requests rather than three),
- for the reference router (kvroute, else the first listed) against each other router: in how
  many seeds its p50 and p99 were lower, the median of the per-seed differences, and the
  pooled p50 and p99 difference with a 95% interval from a paired cluster bootstrap over the
  sessions (``kvroute.testbed.stats.paired_bootstrap``): "lower" / "higher" only when the interval
  excludes zero,
- with the oracle in the run, each router's cached tokens as a share of the oracle's.
- the routers run in a rotated order from seed to seed (the k-th seed starts with the k-th
  router), so a drift of the machine during a run does not always favour the same router.
- the requests both routers answered, split by whether the engines cached the same tokens
  for them under both: the median TTFT difference on the equal ones is what the routers
  themselves cost, on the others what their choices did.

Results: ``bench/results/routing_seeds_<profile>[_vllm].{json,md}``; each seed's own results
and per-request records under ``bench/results/seeds/seed<k>/``.

    python -m bench.routing_seeds --seeds 0,1,2 --profile all --routers kvroute,smg-cache-aware
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.report import engines_label, fmt, markdown_table, routing_markdown, routing_plot
from bench.routing_bench import build_config, parse_args, run_profile
from kvroute.testbed.stats import (
    TTFT_PART_LABELS,
    TTFT_PARTS,
    paired_bootstrap,
    paired_bootstrap_mean,
    percentile,
)

ORACLE = "oracle"


def _ratio(row: dict[str, Any]) -> float | None:
    prompt = row.get("engine_prompt_tokens") or 0
    return row["engine_cached_tokens"] / prompt if prompt else None


def _answered(run_dir: Path, name: str) -> dict[str, dict[str, Any]]:
    """A router's answered requests in one seed's run, by request id."""
    path = run_dir / f"{name}.records.jsonl"
    packed = path.with_name(path.name + ".gz")  # as kept under bench/results
    if not path.exists() and not packed.exists():
        return {}
    if path.exists():
        text = path.read_text("utf-8")
    else:
        text = gzip.decompress(packed.read_bytes()).decode("utf-8")
    out: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        r = json.loads(line)
        if r.get("ttft") is not None and r.get("status") == 200 and r.get("error") is None:
            out[str(r.get("id"))] = r
    return out


def _ttft(r: dict[str, Any]) -> float | None:
    return float(r["ttft"])


def _tpot(r: dict[str, Any]) -> float | None:
    """A record's time per output token after the first (None with fewer than two)."""
    n = int(r.get("output_tokens") or 0)
    if n < 2 or r.get("latency") is None:
        return None
    return (float(r["latency"]) - float(r["ttft"])) / (n - 1)


def _pulled(r: dict[str, Any]) -> float | None:
    """KV blocks the answering decode engine pulled for the request (None: not reported)."""
    x = r.get("pulled_blocks")
    return None if x is None else float(x)


def _by_session(
    answered: dict[str, dict[str, Any]], value: Callable[[dict[str, Any]], float | None] = _ttft
) -> dict[str, list[float]]:
    """A value (TTFT by default) of answered requests (`_answered`) by session (a record
    without one is its own); records without the value are left out."""
    out: dict[str, list[float]] = {}
    for rid, r in answered.items():
        x = value(r)
        if x is not None:
            out.setdefault(r.get("session") or f"request {rid}", []).append(x)
    return out


def history_losses(answered: dict[str, dict[str, Any]]) -> tuple[int, int]:
    """(later turns, those that lost their history): a conversation's turn after its first
    loses its history when the engine reports fewer cached tokens than half the previous
    turn's prompt, which that turn left in some engine's cache (evicted since, or sent where
    it is not). Requests without a session are their own conversation."""
    turns: dict[str, list[dict[str, Any]]] = {}
    for r in answered.values():
        if r.get("session"):
            turns.setdefault(r["session"], []).append(r)
    later = lost = 0
    for rs in turns.values():
        rs.sort(key=lambda r: r.get("sent") or 0.0)
        for prev, cur in itertools.pairwise(rs):
            later += 1
            if 2 * (cur.get("cached_tokens") or 0) < (prev.get("prompt_tokens") or 0):
                lost += 1
    return later, lost


def cache_split(
    seeds: Sequence[tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]],
) -> dict[str, dict[str, Any]]:
    """The requests both routers answered (per seed: reference's and other's by id), split by
    whether the engines reported the same cached tokens for them. TTFT differences (reference
    minus other) where they did measure what the routers themselves cost; where they did not,
    what their routing decisions did."""
    same: list[float] = []
    same_parts: dict[str, list[float]] = {k: [] for k in TTFT_PARTS}
    different: list[float] = []
    more = 0
    for ref, other in seeds:
        for rid, a in ref.items():
            b = other.get(rid)
            if b is None:
                continue
            d = float(a["ttft"]) - float(b["ttft"])
            if (a.get("cached_tokens") or 0) == (b.get("cached_tokens") or 0):
                same.append(d)
                if a.get("return_s") is not None and b.get("return_s") is not None:
                    for k, diffs in same_parts.items():
                        diffs.append(float(a[k]) - float(b[k]))
            else:
                different.append(d)
                more += (a.get("cached_tokens") or 0) > (b.get("cached_tokens") or 0)

    def median(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    return {
        "same_cache": {
            "requests": len(same),
            "median_diff_s": median(same),
            # where the engines reported their timing: the median difference of each part
            "parts_median_diff_s": {k: median(v) for k, v in same_parts.items() if v},
        },
        "different_cache": {
            "requests": len(different),
            "reference_more_cached": more,
            "median_diff_s": median(different),
        },
    }


def _pairs(
    sessions: dict[tuple[int, str], dict[str, list[float]]],
    seeds: Sequence[int],
    ref: str,
    other: str,
) -> list[tuple[list[float], list[float]]]:
    """One (reference TTFTs, other TTFTs) cluster per session of each seed."""
    out = []
    for s in seeds:
        a, b = sessions[s, ref], sessions[s, other]
        out += [(a.get(k, []), b.get(k, [])) for k in sorted(a.keys() | b.keys())]
    return out


def _spread(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def aggregate(
    per_seed: dict[int, dict[str, Any]], run_dirs: dict[int, Path], reference: str | None = None
) -> dict[str, Any]:
    """Per-router statistics over the seeds' results (``run_profile`` outputs by seed); the
    paired comparisons are `reference`'s (default: kvroute, else the first router seen)."""
    seeds = sorted(per_seed)
    names: list[str] = []
    labels: dict[str, str] = {}
    for s in seeds:
        for row in per_seed[s]["routers"]:
            if row["name"] not in names:
                names.append(row["name"])
                labels[row["name"]] = row.get("label", row["name"])
    ok = {s: {r["name"]: r for r in per_seed[s]["routers"] if r["status"] == "ok"} for s in seeds}
    # each router's records of each seed, read once
    answered = {(s, name): _answered(run_dirs[s], name) for s in seeds for name in ok[s]}
    sessions = {k: _by_session(v) for k, v in answered.items()}
    pd = any("pd" in row for s in seeds for row in ok[s].values())
    tpots = {k: _by_session(v, _tpot) for k, v in answered.items()} if pd else {}
    pulls = {k: _by_session(v, _pulled) for k, v in answered.items()} if pd else {}
    routers: list[dict[str, Any]] = []
    for name in names:
        rows = {s: ok[s][name] for s in seeds if name in ok[s]}
        pooled = [t for s in rows for ts in sessions[s, name].values() for t in ts]
        losses = [history_losses(answered[s, name]) for s in rows]
        stats: dict[str, Any] = {
            "name": name,
            "label": labels[name],
            "earlier_run": next(
                (r["earlier_run"] for r in rows.values() if r.get("earlier_run")), None
            ),
            "seeds": sorted(rows),
            "cached_ratio": _spread([x for r in rows.values() if (x := _ratio(r)) is not None]),
            "ttft_p50": _spread([r["summary"]["ttft_p50"] for r in rows.values()]),
            "ttft_p99": _spread([r["summary"]["ttft_p99"] for r in rows.values()]),
            "history": {
                "later_turns": sum(n for n, _ in losses),
                "lost": sum(k for _, k in losses),
            },
            "pooled": {
                "requests": len(pooled),
                "ttft_p50": percentile(pooled, 50),
                "ttft_p90": percentile(pooled, 90),
                "ttft_p99": percentile(pooled, 99),
            },
        }
        if pd:
            pooled_tpot = [t for s in rows for ts in tpots[s, name].values() for t in ts]
            pooled_blocks = [b for s in rows for bs in pulls[s, name].values() for b in bs]
            stats["pd"] = pd_spreads(list(rows.values()), pooled_tpot, pooled_blocks)
        routers.append(stats)
    if reference is not None and reference in names:
        ref: str | None = reference
    else:  # (main refuses a --reference that is not among the routers)
        ref = "kvroute" if "kvroute" in names else (names[0] if names else None)
    paired: list[dict[str, Any]] = []
    for name in names:
        if ref is None or name == ref:
            continue
        common = [s for s in seeds if name in ok[s] and ref in ok[s]]
        entry: dict[str, Any] = {"reference": ref, "other": name, "seeds": common}
        for q in ("ttft_p50", "ttft_p99"):
            diffs = [ok[s][ref]["summary"][q] - ok[s][name]["summary"][q] for s in common]
            entry[q] = {
                "reference_lower": sum(1 for d in diffs if d < 0),
                "median_diff_s": statistics.median(diffs) if diffs else None,
            }
        entry["by_cache"] = cache_split([(answered[s, ref], answered[s, name]) for s in common])
        clusters = _pairs(sessions, common, ref, name)
        entry["pooled_diff"] = {}
        for q, pct in (("ttft_p50", 50.0), ("ttft_p99", 99.0)):
            d = paired_bootstrap(clusters, pct)
            entry["pooled_diff"][q] = None if d is None else d.to_json()
        if pd:
            clusters = _pairs(tpots, common, ref, name)
            for q, pct in (("tpot_p50", 50.0), ("tpot_p99", 99.0)):
                d = paired_bootstrap(clusters, pct)
                entry["pooled_diff"][q] = None if d is None else d.to_json()
            d = paired_bootstrap_mean(_pairs(pulls, common, ref, name))
            entry["pooled_diff"]["blocks_per_request"] = None if d is None else d.to_json()
        paired.append(entry)
    _add_oracle_share(routers, ok)
    return {"seeds": seeds, "reference": ref, "routers": routers, "paired": paired}


def pd_spreads(
    rows: Sequence[dict[str, Any]],
    pooled_tpot: Sequence[float],
    pooled_blocks: Sequence[float] = (),
) -> dict[str, Any]:
    """A prefill/decode router's per-seed results (routing_bench rows with ``pd``) as medians
    and ranges over the seeds, with the TPOT percentiles of every seed's requests pooled and
    the mean of the KV blocks pulled for each request that reported them (None: none did)."""

    def spread(get: Callable[[dict[str, Any]], Any]) -> dict[str, float] | None:
        return _spread([float(x) for r in rows if "pd" in r and (x := get(r)) is not None])

    return {
        "tpot_p50": spread(lambda r: r["summary"].get("tpot_p50")),
        "tpot_p99": spread(lambda r: r["summary"].get("tpot_p99")),
        "prefill_cached_ratio": spread(lambda r: r["pd"]["prefill"]["cached_ratio"]),
        "decode_cached_ratio": spread(lambda r: r["pd"]["decode"]["cached_ratio"]),
        "pulls_per_request": spread(lambda r: r["pd"]["kv_pulls_per_request"]),
        "blocks_per_request": spread(lambda r: r["pd"]["kv_blocks_per_request"]),
        "pooled": {
            "requests": len(pooled_tpot),
            "tpot_p50": percentile(pooled_tpot, 50),
            "tpot_p99": percentile(pooled_tpot, 99),
            "blocks_requests": len(pooled_blocks),
            "blocks_per_request": statistics.fmean(pooled_blocks) if pooled_blocks else None,
        },
    }


def _add_oracle_share(routers: list[dict[str, Any]], ok: dict[int, dict[str, Any]]) -> None:
    """Each router's cached tokens as a share of the oracle's, summed over the seeds both ran
    (``vs_oracle``; None without an oracle row)."""
    for r in routers:
        seeds = [s for s in r["seeds"] if ORACLE in ok[s]]
        mine = sum(ok[s][r["name"]]["engine_cached_tokens"] for s in seeds)
        theirs = sum(ok[s][ORACLE]["engine_cached_tokens"] for s in seeds)
        r["vs_oracle"] = mine / theirs if seeds and theirs else None


def _lost(h: dict[str, int] | None) -> str:
    if not h or not h["later_turns"]:
        return "-"
    return f"{h['lost']}/{h['later_turns']} ({h['lost'] / h['later_turns']:.1%})"


def _range(sp: dict[str, float] | None, pct: bool = False) -> str:
    if sp is None:
        return "-"
    return f"{fmt(sp['median'], pct=pct)} ({fmt(sp['min'], pct=pct)}-{fmt(sp['max'], pct=pct)})"


def markdown(profile: str, agg: dict[str, Any], first: dict[str, Any], command: str) -> str:
    """The seeds' table for one profile."""
    seeds = agg["seeds"]
    trace = first["trace"]["name"].split(",")[0]
    lines = [
        f"# Routing benchmark over {len(seeds)} seeds: profile `{profile}`",
        "",
        f"Fleet: {engines_label(first['fleet'])} ({profile}, cache backend "
        f"{first['fleet']['cache_backend']}); traces: {trace}, seeds "
        f"{', '.join(map(str, seeds))} (about {first['trace']['requests']} requests each); "
        f"replay: {first['replay']}. Each seed runs every router on a fresh fleet, one after "
        "another. Per-seed values are medians over seeds (range in brackets); pooled = every "
        "request of every seed together. A later turn lost its history when the engine "
        "reported fewer cached tokens than half the previous turn's prompt (evicted between "
        "the turns, or sent where it was not).",
        "",
    ]
    headers = [
        "router",
        "seeds",
        "cached % (median, range)",
        "TTFT p50 (s)",
        "TTFT p99 (s)",
        "later turns that lost their history",
        "pooled requests",
        "pooled p50",
        "pooled p90",
        "pooled p99",
    ]
    rows = [
        [
            r["label"],
            str(len(r["seeds"])),
            _range(r["cached_ratio"], pct=True),
            _range(r["ttft_p50"]),
            _range(r["ttft_p99"]),
            _lost(r.get("history")),
            str(r["pooled"]["requests"]),
            fmt(r["pooled"]["ttft_p50"]),
            fmt(r["pooled"]["ttft_p90"]),
            fmt(r["pooled"]["ttft_p99"]),
        ]
        for r in agg["routers"]
    ]
    if any(r.get("vs_oracle") is not None for r in agg["routers"]):
        headers.insert(3, "cached vs oracle")
        for row, r in zip(rows, agg["routers"], strict=True):
            row.insert(3, fmt(r.get("vs_oracle"), pct=True))
    lines += [markdown_table(headers, rows), ""]
    lines += _pd_lines(agg)
    carried = sorted(
        {f"{r['label']} ({r['earlier_run']})" for r in agg["routers"] if r.get("earlier_run")}
    )
    if carried:
        lines += [
            "Not re-run in this run (rows kept from the earlier run of the same seeds and fleet, "
            f"dated): {', '.join(carried)}.",
            "",
        ]
    if agg["paired"]:
        ref = agg["reference"]
        lines += [
            f"Paired by seed, `{ref}` against each other router (negative: {ref} faster):",
            "",
        ]
        prow = []
        for p in agg["paired"]:
            n = len(p["seeds"])
            cells = [p["other"], str(n)]
            for q in ("ttft_p50", "ttft_p99"):
                d = p[q]["median_diff_s"]
                cells.append(
                    f"{p[q]['reference_lower']}/{n}, median "
                    + ("-" if d is None else f"{d * 1000:+.1f} ms")
                )
            for q in ("ttft_p50", "ttft_p99"):
                cells.append(_interval(p.get("pooled_diff", {}).get(q)))
            prow.append(cells)
        headers = ["other router", "seeds", f"{ref} p50 lower in", f"{ref} p99 lower in"]
        headers += [f"pooled {q}: {ref} minus other (95% CI)" for q in ("p50", "p99")]
        lines += [
            markdown_table(headers, prow),
            "",
            "The intervals resample whole sessions, the same ones for both routers (a paired "
            "cluster bootstrap over every seed's sessions, 1,000 draws): they say how much the "
            "pooled percentile depends on which sessions the traces happened to hold, not how "
            "much a rerun of the same trace on this machine would move.",
            "",
            *_cache_split_lines(agg["paired"], ref),
        ]
    lines += [f"Command: `{command}`", ""]
    return "\n".join(lines)


def _pd_lines(agg: dict[str, Any]) -> list[str]:
    """The prefill/decode table (median over seeds, range in brackets) and the pooled TPOT
    differences against the reference; nothing for a run of mixed engines."""
    runs = [r for r in agg["routers"] if r.get("pd")]
    if not runs:
        return []
    rows = [
        [
            r["label"],
            _range_ms(r["pd"]["tpot_p50"]),
            _range_ms(r["pd"]["tpot_p99"]),
            _ms_abs(r["pd"]["pooled"]["tpot_p50"]),
            _ms_abs(r["pd"]["pooled"]["tpot_p99"]),
            _range(r["pd"]["prefill_cached_ratio"], pct=True),
            _range(r["pd"]["decode_cached_ratio"], pct=True),
            _range(r["pd"]["pulls_per_request"]),
            _range(r["pd"]["blocks_per_request"]),
            _blocks(r["pd"]["pooled"].get("blocks_per_request")),
        ]
        for r in runs
    ]
    headers = [
        "router",
        "TPOT p50 (ms)",
        "TPOT p99 (ms)",
        "pooled TPOT p50",
        "pooled TPOT p99",
        "prefill pool cached %",
        "decode pool cached %",
        "pulls per request",
        "blocks pulled per request",
        "pooled blocks per request",
    ]
    lines = [
        "Prefill/decode (median over seeds, range in brackets): time per output token after "
        "the first; the prompt tokens each pool's engines found in their own prefix cache; the "
        "decode engines' pulls from a prefill engine and the 16-token KV blocks they moved, per "
        "answered request; pooled: the mean over every request whose decode engine reported "
        "its pull.",
        "",
        markdown_table(headers, rows),
        "",
    ]
    ref = agg["reference"]
    prow = [
        [
            p["other"],
            *(_interval(p["pooled_diff"].get(q), 2) for q in ("tpot_p50", "tpot_p99")),
            _interval(p["pooled_diff"].get("blocks_per_request"), 1, scale=1.0, unit=""),
        ]
        for p in agg["paired"]
        if "tpot_p50" in p.get("pooled_diff", {})
    ]
    if prow:
        lines += [
            markdown_table(
                [
                    "other router",
                    *(f"pooled TPOT {q}: {ref} minus other (95% CI)" for q in ("p50", "p99")),
                    f"blocks per request: {ref} minus other (95% CI)",
                ],
                prow,
            ),
            "",
        ]
    return lines


def _blocks(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _range_ms(sp: dict[str, float] | None) -> str:
    if sp is None:
        return "-"
    return f"{sp['median'] * 1000:.2f} ({sp['min'] * 1000:.2f}-{sp['max'] * 1000:.2f})"


def _ms_abs(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.2f}"


def _cache_split_lines(paired: list[dict[str, Any]], ref: str) -> list[str]:
    rows = []
    for p in paired:
        bc = p.get("by_cache")
        if not bc:
            continue
        same, diff = bc["same_cache"], bc["different_cache"]
        rows.append(
            [
                p["other"],
                f"{same['requests']}: {_ms(same['median_diff_s'])}",
                f"{diff['requests']} ({diff['reference_more_cached']} with more cached under "
                f"{ref}): {_ms(diff['median_diff_s'])}",
            ]
        )
    if not rows:
        return []
    lines = [
        f"The same requests paired by id (TTFT {ref} minus other, median): where the engines "
        "reported equal cached tokens under both routers the difference is what the routers "
        "themselves cost; where not, what their choices did.",
        "",
        markdown_table(
            [
                "other router",
                "equal cached tokens: requests, median",
                "different: requests, median",
            ],
            rows,
        ),
        "",
    ]
    parts = [
        (p["other"], p["by_cache"]["same_cache"].get("parts_median_diff_s") or {})
        for p in paired
        if p.get("by_cache")
    ]
    parts = [(other, d) for other, d in parts if d]
    if parts:
        lines += [
            "Those equal-cache requests part by part (median of the paired differences; the "
            "engines stamp when they receive a request's headers, queue it, admit it and emit "
            "its first token): the forward hop and the relay back are the router's own work.",
            "",
            markdown_table(
                ["other router", *TTFT_PART_LABELS],
                [[other, *(_ms(d.get(k)) for k in TTFT_PARTS)] for other, d in parts],
            ),
            "",
        ]
    return lines


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:+.2f} ms"


def _interval(
    d: dict[str, Any] | None, nd: int = 1, *, scale: float = 1000.0, unit: str = " ms"
) -> str:
    """A difference with its interval (seconds shown as ms by default; `scale` 1 and no
    `unit` for counts such as blocks)."""
    if d is None:
        return "-"
    lo, diff, hi = (f"{d[k] * scale:+.{nd}f}" for k in ("low", "diff", "high"))
    return f"{diff}{unit} [{lo}, {hi}]: {d['verdict']}"


def merge_earlier(new: dict[str, Any], earlier: dict[str, Any] | None) -> dict[str, Any]:
    """``new`` with the rows of ``earlier`` for routers it did not run, in earlier's order.

    Carried rows get ``earlier_run`` (that run's date) so tables can say they were not re-run."""
    if earlier is None:
        return new
    fresh = {r["name"]: r for r in new["routers"]}
    rows = []
    for row in earlier["routers"]:
        if row["name"] in fresh:
            rows.append(fresh.pop(row["name"]))
        else:
            rows.append({**row, "earlier_run": row.get("earlier_run", earlier.get("created"))})
    return {**new, "routers": rows + list(fresh.values())}


def rotated(routers: Sequence[str], k: int) -> list[str]:
    """``routers`` starting from the k-th (modulo their number)."""
    if not routers:
        return []
    k %= len(routers)
    return [*routers[k:], *routers[:k]]


def _split_args(argv: Sequence[str]) -> tuple[list[int], list[str], bool, bool, str | None]:
    p = argparse.ArgumentParser(
        prog="python -m bench.routing_seeds",
        description=__doc__,
        epilog="Other options are routing_bench's (--profile, --routers, --cache-backend, ...).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # "--seed" must not be taken for "--seeds"
    )
    p.add_argument("--seeds", default="0,1,2", help="comma list of trace seeds")
    p.add_argument(
        "--keep-other-routers",
        action="store_true",
        help="re-run only --routers: the other routers' rows (and records) of an earlier run in "
        "the same output directory stay in each seed's results, marked with that run's date",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: aggregate the seeds' results already in the output directory again "
        "(after a change to this report)",
    )
    p.add_argument(
        "--reference",
        default=None,
        help="the router the paired comparisons are against the others (default: kvroute, "
        "else the first listed)",
    )
    known, rest = p.parse_known_args(argv)
    seeds = [int(s) for s in known.seeds.split(",") if s.strip()]
    if not seeds:
        p.error("--seeds needs at least one seed")
    if "--seed" in rest:
        p.error("use --seeds, not --seed")
    return seeds, rest, known.keep_other_routers, known.report_only, known.reference


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    seeds, rest, keep_others, report_only, reference = _split_args(argv)
    base = parse_args(rest)
    out_root = Path(base.out_dir)
    command = "python -m bench.routing_seeds " + shlex.join(argv)
    failed = 0
    configs = {}
    for seed in seeds:
        args = parse_args(
            [*rest, "--seed", str(seed), "--out-dir", str(out_root / "seeds" / f"seed{seed}")]
        )
        cfg = build_config(args)
        # by rank among the seeds: the smallest (whose rows order the report) keeps the order
        configs[seed] = replace(cfg, routers=tuple(rotated(cfg.routers, sorted(seeds).index(seed))))
    first_cfg = configs[seeds[0]]
    if reference is not None and reference not in first_cfg.routers:
        raise SystemExit(f"--reference {reference!r} is not one of --routers {first_cfg.routers}")
    for profile in first_cfg.profiles:
        per_seed: dict[int, dict[str, Any]] = {}
        run_dirs: dict[int, Path] = {}
        for seed in seeds:
            cfg = configs[seed]
            cfg.out_dir.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            seed_stem = cfg.out_dir / f"routing_{profile}{cfg.suffix}"
            earlier = None
            if (keep_others or report_only) and seed_stem.with_suffix(".json").exists():
                earlier = json.loads(seed_stem.with_suffix(".json").read_text())
            if report_only:
                if earlier is None:
                    raise SystemExit(f"--report-only: no {seed_stem.with_suffix('.json')}")
                result = earlier
            else:
                result = run_profile(cfg, profile, command + f" (seed {seed})")
            if earlier is not None and not report_only:
                result = merge_earlier(result, earlier)
                seed_stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
                seed_stem.with_suffix(".md").write_text(routing_markdown(result))
                routing_plot(result, seed_stem.with_suffix(".png"))
            per_seed[seed] = result
            run_dirs[seed] = cfg.out_dir / "runs" / f"routing_{profile}{cfg.suffix}"
            failed += sum(1 for r in per_seed[seed]["routers"] if r["status"] == "failed")
            print(f"[{profile}] seed {seed} done in {time.monotonic() - t0:.0f}s", file=sys.stderr)
        if report_only:  # the command that ran the seeds, not this one
            command = str(per_seed[seeds[0]].get("command", command)).split(" (seed ")[0]
        agg = aggregate(per_seed, run_dirs, reference)
        agg.update(profile=profile, command=command, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        stem = out_root / f"routing_seeds_{profile}{first_cfg.suffix}"
        stem.with_suffix(".json").write_text(json.dumps(agg, indent=2) + "\n")
        md = markdown(profile, agg, per_seed[seeds[0]], command)
        stem.with_suffix(".md").write_text(md)
        print(md)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
