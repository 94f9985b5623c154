"""Where the time of a prefill/decode run went, router by router, and how kvroute chose.

Reads the runs of ``bench.routing_seeds --pd P,D`` (each seed's ``runs/routing_<profile>_pd``
folder: the routers' ``*.records.jsonl[.gz]`` and ``kvroute.decisions.jsonl``) and prints, in
Markdown:

- per router, over every seed's answered requests, the median and p90 of each part of the
  time to first token as the decode engine stamps it: the prefill phase (from the client's
  send until the decode engine has the request: the prefill engine's queue and work and the
  router's hops), the decode engine's reading of the request (its pull of the prompt's KV
  included), its queue, its first step, and the way back;
- how each router spread the requests over the decode engines (the engine that answered);
- from kvroute's decisions: the reasons of its prefill choices, how many prefill and decode
  workers it used, how often the decode it chose was the one with the most predicted reuse,
  and the prefill and decode phases as it timed them.

    python -m bench.pd_diagnosis --results bench/results/2026-12-06-pd-routing
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.report import markdown_table
from kvroute.testbed.stats import percentile, read_records

PARTS = ("forward_s", "parse_s", "queue_s", "prefill_s", "return_s")
PART_LABELS = ("prefill phase", "decode reads (pull)", "decode queue", "decode first step", "back")


def run_dirs(results: Path) -> list[Path]:
    """Every seed's P/D run folder under a routing_seeds output folder."""
    return sorted(p for p in results.glob("seeds/seed*/runs/routing_*_pd") if p.is_dir())


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def parts_table(records: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Median (p90) of each TTFT part per router, over its answered requests."""
    rows = []
    for name, recs in records.items():
        ok = [r for r in recs if r.get("ttft") is not None and r.get("return_s") is not None]
        cells = [name, str(len(ok)), f"{_ms(percentile([r['ttft'] for r in ok], 50))}"]
        for k in PARTS:
            xs = [float(r[k]) for r in ok]
            cells.append(f"{_ms(percentile(xs, 50))} ({_ms(percentile(xs, 90))})")
        rows.append(cells)
    return [
        markdown_table(["router", "requests", "TTFT p50", *PART_LABELS], rows),
        "",
        "Milliseconds, median (p90) over every seed's answered requests.",
    ]


def spread_table(records: dict[str, list[dict[str, Any]]]) -> list[str]:
    """How many requests each engine answered, per router (the decode engines in P/D)."""
    rows = []
    for name, recs in records.items():
        counts = Counter(str(r.get("worker")) for r in recs if r.get("ttft") is not None)
        rows.append([name, ", ".join(f"{w} {n}" for w, n in sorted(counts.items()))])
    return [markdown_table(["router", "answered by"], rows)]


def decisions_summary(decisions: Iterable[dict[str, Any]]) -> list[str]:
    """kvroute's P/D choices: prefill reasons and workers, decode workers, whether the chosen
    decode had the most predicted reuse, and each phase's time as the router measured it."""
    reasons: Counter[str] = Counter()
    prefill: Counter[str] = Counter()
    decode: Counter[str] = Counter()
    most_reuse = compared = 0
    prefill_s: list[float] = []
    decode_s: list[float] = []
    for d in decisions:
        pd = d.get("pd")
        if not pd or not pd.get("prefill") or not pd.get("decode"):
            continue
        reasons[str(d.get("reason"))] += 1
        prefill[pd["prefill"][-1]["worker"]] += 1
        chosen = pd["decode"][-1]["worker"]
        decode[chosen] += 1
        prefill_s.append(float(pd["prefill"][-1]["seconds"]))
        decode_s.append(float(pd["decode"][-1]["seconds"]))
        reuse = {c["worker"]: c.get("predicted_reuse") or 0 for c in pd.get("decode_candidates")}
        if len(set(reuse.values())) > 1 and chosen in reuse:
            compared += 1
            most_reuse += reuse[chosen] == max(reuse.values())

    def counts(c: Counter[str]) -> str:
        return ", ".join(f"{k} {n}" for k, n in sorted(c.items()))

    return [
        f"- prefill choices by reason: {counts(reasons)}",
        f"- prefill workers: {counts(prefill)}; decode workers: {counts(decode)}",
        f"- decode choices where the candidates' predicted reuse differed: {compared}; the "
        f"chosen one had the most in {most_reuse}",
        f"- prefill phase as kvroute timed it (dispatch to answer): p50 "
        f"{_ms(percentile(prefill_s, 50))} ms, p90 {_ms(percentile(prefill_s, 90))} ms; decode "
        f"dispatch to first byte: p50 {_ms(percentile(decode_s, 50))} ms, p90 "
        f"{_ms(percentile(decode_s, 90))} ms",
    ]


def report(dirs: Sequence[Path]) -> str:
    """The Markdown diagnosis of these P/D run folders."""
    names = sorted({p.name.split(".")[0] for d in dirs for p in d.glob("*.records.jsonl*")})
    records = {n: [r for d in dirs for r in read_records(d / f"{n}.records.jsonl")] for n in names}
    decisions = [x for d in dirs for x in read_records(d / "kvroute.decisions.jsonl")]
    lines = [f"# Prefill/decode diagnosis ({len(dirs)} runs)", "", *parts_table(records), ""]
    lines += [*spread_table(records), ""]
    if decisions:
        lines += ["kvroute's decisions (`/admin/decisions`):", "", *decisions_summary(decisions)]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pd_diagnosis", description=__doc__)
    p.add_argument("--results", required=True, help="a routing_seeds --pd output folder")
    args = p.parse_args(argv)
    dirs = run_dirs(Path(args.results))
    if not dirs:
        raise SystemExit(f"no seeds/seed*/runs/routing_*_pd folders under {args.results}")
    print(report(dirs), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
