"""`kvroute demo --pd`'s outputs: the table, the summary lines and the picture of what the
cache-aware choice bought on each pool of a prefill/decode fleet (the numbers come from
:mod:`kvroute.demo.pd`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvroute.demo.report import (
    compare,
    figure,
    format_table,
    save,
    secs,
    ttft_bars,
    ttft_cdf,
    value_bars,
)
from kvroute.demo.run import RunResult

HEADERS = (
    "policy",
    "prefill tokens computed",
    "prefill cache hits",
    "tokens pulled / request",
    "TTFT p50",
    "TTFT p99",
)


def _pools(r: RunResult) -> dict[str, Any]:
    if r.pd is None:
        raise ValueError(f"run {r.policy!r} has no prefill/decode numbers")
    return r.pd


def table(runs: Sequence[RunResult]) -> str:
    """A plain-text table, one row per run."""
    rows = []
    for r in runs:
        p, d = _pools(r)["prefill"], _pools(r)["decode"]
        rows.append(
            (
                r.label,
                f"{p['computed_tokens']:,} of {p['prompt_tokens']:,}",
                f"{p['cached_share']:.1%}",
                f"{d['pulled_tokens_per_request']:,.0f}",
                secs(r.summary["ttft_p50"]),
                secs(r.summary["ttft_p99"]),
            )
        )
    return format_table(HEADERS, rows)


def _fewer(aware: float, baseline: float) -> str:
    if aware <= 0:
        return "none at all"
    return (
        f"{baseline / aware:.2f}x fewer" if aware <= baseline else f"{aware / baseline:.2f}x more"
    )


def headline(aware: RunResult, baseline: RunResult) -> list[str]:
    """What the comparison says about each pool (numbers from the runs)."""
    ap, bp = _pools(aware)["prefill"], _pools(baseline)["prefill"]
    ad, bd = _pools(aware)["decode"], _pools(baseline)["decode"]
    computed = _fewer(ap["computed_tokens"], bp["computed_tokens"])
    out = [
        f"Prefill pool: cache-aware choice computed {ap['computed_tokens']:,} prompt tokens, "
        f"round robin {bp['computed_tokens']:,} ({computed}; cache hits "
        f"{ap['cached_share']:.0%} vs {bp['cached_share']:.0%}).",
        f"Decode pool: a decode worker pulled {ad['pulled_tokens_per_request']:,.0f} tokens per "
        f"request with kvroute, {bd['pulled_tokens_per_request']:,.0f} with round robin "
        f"({_fewer(ad['pulled_tokens'], bd['pulled_tokens'])}): it already held "
        f"{ad['held_tokens']:,} prompt tokens, against {bd['held_tokens']:,}.",
    ]
    a, b = aware.summary, baseline.summary
    if a["ttft_p50"] and b["ttft_p50"] and a["ttft_p99"] and b["ttft_p99"]:
        out.append(
            f"Time to first token with kvroute: {compare(a['ttft_p50'], b['ttft_p50'])} at the "
            f"median, {compare(a['ttft_p99'], b['ttft_p99'])} at p99, than with round robin."
        )
    return out


def write_png(path: Path, title: str, runs: Sequence[RunResult]) -> None:
    """Four panels: prefill tokens computed, tokens pulled per request, TTFT p50/p99, TTFT
    distribution."""
    from matplotlib.ticker import FuncFormatter

    fig, axes = figure(title)
    thousands = FuncFormatter(lambda v, _pos: f"{v:,.0f}")
    ax = axes[0][0]
    value_bars(ax, runs, [_pools(r)["prefill"]["computed_tokens"] for r in runs], ",.0f")
    ax.set_ylabel("prompt tokens")
    ax.yaxis.set_major_formatter(thousands)
    ax.set_title("Prefill pool: prompt tokens computed (not found in cache)", fontsize=10)

    ax = axes[0][1]
    value_bars(ax, runs, [_pools(r)["decode"]["pulled_tokens_per_request"] for r in runs], ",.0f")
    ax.set_ylabel("tokens per request")
    ax.yaxis.set_major_formatter(thousands)
    ax.set_title("Decode pool: KV pulled from the prefill pool per request", fontsize=10)

    ttft_bars(axes[1][0], runs)
    ttft_cdf(axes[1][1], runs)
    save(fig, path)
