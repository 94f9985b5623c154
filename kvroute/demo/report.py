"""The demo's outputs: the terminal table, the summary lines, the JSON and the picture."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvroute.demo.run import RunResult

HEADERS = ("policy", "cache-hit tokens", "TTFT p50", "TTFT p99", "throughput", "prediction error")


def secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"


def _prediction(p: dict[str, Any] | None) -> str:
    if not p:
        return "-"
    exact = p["exact"] / p["verified"] if p["verified"] else 0.0
    return f"{p['abs_error_share']:.1%} ({exact:.0%} exact)"


def table_rows(runs: Sequence[RunResult]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for r in runs:
        s = r.summary
        rows.append(
            (
                r.label,
                f"{s['cached_ratio']:.1%} of {s['prompt_tokens']:,}",
                secs(s["ttft_p50"]),
                secs(s["ttft_p99"]),
                f"{s['req_per_s']:.2f} req/s, {s['output_tok_per_s']:.0f} tok/s",
                _prediction(r.prediction),
            )
        )
    return rows


def format_table(headers: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """A plain-text table: the headers, a rule, then the rows."""
    rows = [headers, *body]
    widths = [max(len(row[i]) for row in rows) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def table(runs: Sequence[RunResult]) -> str:
    """A plain-text table, one row per run."""
    return format_table(HEADERS, table_rows(runs))


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def compare(aware: float, baseline: float) -> str:
    if aware <= baseline:
        return f"{baseline / aware:.2f}x lower ({aware:.3f} s vs {baseline:.3f} s)"
    return f"{aware / baseline:.2f}x higher ({aware:.3f} s vs {baseline:.3f} s)"


def headline(aware: RunResult, baseline: RunResult) -> list[str]:
    """What the comparison says, in a few sentences (numbers from the runs)."""
    a, b = aware.summary, baseline.summary
    out = []
    more = _ratio(a["cached_tokens"], b["cached_tokens"])
    if more is not None:
        out.append(
            f"Cache-aware routing served {a['cached_ratio']:.0%} of prompt tokens from cache, "
            f"round robin {b['cached_ratio']:.0%} ({more:.2f}x the cached tokens)."
        )
    if a["ttft_p50"] and b["ttft_p50"] and a["ttft_p99"] and b["ttft_p99"]:
        out.append(
            f"Time to first token with kvroute: {compare(a['ttft_p50'], b['ttft_p50'])} at the "
            f"median, {compare(a['ttft_p99'], b['ttft_p99'])} at p99, than with round robin."
        )
    p = aware.prediction
    if p:
        out.append(
            f"The router's predicted reuse was checked against the engines' reported "
            f"cached_tokens on {p['verified']} responses: {p['exact']} exact, mean error "
            f"{p['mean_abs_error_tokens']:.1f} tokens per request."
        )
    h = aware.hybrid
    if h and h.get("pairs"):
        out.append(
            f"Hybrid correctness, probed after the run ({h['prompts']} prompts x every worker, "
            f"against each engine's true hit): kvroute exact in "
            f"{h['kvroute_exact_share']:.0%} of {h['pairs']} cases; an index of the "
            f"full-attention blocks alone would overstate the hit in "
            f"{h['full_attention_only_over_share']:.0%} of them, by "
            f"{h['full_attention_only_mean_overstatement_tokens']:,.0f} tokens on average."
        )
    return out


def write_json(path: Path, setup: dict[str, Any], runs: Sequence[RunResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"demo": setup, "runs": [r.to_json() for r in runs]}
    path.write_text(json.dumps(doc, indent=2) + "\n")


COLORS = {"kvroute": "#2a7ab0", "round_robin": "#c9752b"}


def cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def ttft_bars(ax: Any, runs: Sequence[RunResult]) -> None:
    """TTFT p50 and p99 of each run, side by side."""
    colors = [COLORS.get(r.policy, "#777777") for r in runs]
    width = 0.38
    xs = range(len(runs))
    p50 = [r.summary["ttft_p50"] or 0.0 for r in runs]
    p99 = [r.summary["ttft_p99"] or 0.0 for r in runs]
    b1 = ax.bar([x - width / 2 for x in xs], p50, width, color=colors, label="p50")
    b2 = ax.bar([x + width / 2 for x in xs], p99, width, color=colors, alpha=0.55, label="p99")
    ax.bar_label(b1, labels=[f"p50 {v:.2f}s" for v in p50], padding=2, fontsize=8)
    ax.bar_label(b2, labels=[f"p99 {v:.2f}s" for v in p99], padding=2, fontsize=8)
    ax.set_xticks(list(xs), [r.label for r in runs])
    ax.set_ylabel("seconds")
    ax.set_title("Time to first token")
    ax.set_ylim(0, max([*p99, 0.1]) * 1.2)


def ttft_cdf(ax: Any, runs: Sequence[RunResult]) -> None:
    """Each run's TTFT distribution."""
    for r in runs:
        ttfts = [x.ttft for x in r.records if x.ok and x.ttft is not None]
        if ttfts:
            cx, cy = cdf(ttfts)
            ax.step(cx, cy, where="post", color=COLORS.get(r.policy, "#777777"), label=r.label)
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.set_title("TTFT distribution")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")


def value_bars(
    ax: Any, runs: Sequence[RunResult], values: Sequence[float], fmt: str, unit: str = ""
) -> None:
    """One bar per run, labelled with its value (`fmt`: a format spec, e.g. ",.0f")."""
    colors = [COLORS.get(r.policy, "#777777") for r in runs]
    bars = ax.bar([r.label for r in runs], values, color=colors)
    ax.bar_label(bars, labels=[format(v, fmt) + unit for v in values], padding=2)
    ax.set_ylim(0, max([*values, 1]) * 1.18)


def figure(title: str) -> tuple[Any, Any]:
    """A 2x2 figure (matplotlib without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.2), dpi=100)
    fig.suptitle(title, fontsize=12)
    return fig, axes


def save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_png(path: Path, title: str, runs: Sequence[RunResult]) -> None:
    """Four panels: cache-hit share, TTFT p50/p99, TTFT distribution, hybrid prediction."""
    from matplotlib.ticker import FuncFormatter

    fig, axes = figure(title)
    ax = axes[0][0]
    value_bars(ax, runs, [100 * r.cached_share for r in runs], ".1f", "%")
    ax.set_ylabel("% of prompt tokens")
    ax.set_title("Prompt tokens served from cache (engine-reported)")
    ax.set_ylim(0, 105)

    ttft_bars(axes[0][1], runs)
    ttft_cdf(axes[1][0], runs)

    ax = axes[1][1]
    hybrid = next((r.hybrid for r in runs if r.hybrid and r.hybrid.get("pairs")), None)
    if hybrid:
        names = ["engine's true hit", "kvroute predicts", "full-attention-only\nindex predicts"]
        vals = [
            hybrid["true_cached_tokens"],
            hybrid["kvroute_predicted_tokens"],
            hybrid["full_attention_only_predicted_tokens"],
        ]
        bars = ax.bar(names, vals, color=["#555555", COLORS["kvroute"], "#b84a4a"])
        ax.bar_label(bars, labels=[f"{v:,}" for v in vals], padding=2, fontsize=9)
        ax.set_ylabel("reusable tokens, summed")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}"))
        ax.set_title(
            f"Hybrid model: predicted vs true reuse\n({hybrid['pairs']} prompt x worker probes)",
            fontsize=10,
        )
        ax.set_ylim(0, max([*vals, 1]) * 1.18)
    else:
        ax.axis("off")
    save(fig, path)
