"""Tables (Markdown) and plots (PNG, matplotlib Agg) of benchmark results."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvroute.testbed.stats import TTFT_PART_LABELS, TTFT_PARTS


def fmt(x: Any, nd: int = 3, pct: bool = False) -> str:
    """A table cell: '-' for missing, percentages with one decimal."""
    if x is None:
        return "-"
    if pct:
        return f"{100.0 * float(x):.1f}%"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _busy(per_engine: list[float] | None) -> str:
    """Total simulated GPU seconds and the busiest engine relative to the mean."""
    if not per_engine or not sum(per_engine):
        return "-"
    mean = sum(per_engine) / len(per_engine)
    return f"{sum(per_engine):.0f} ({max(per_engine) / mean:.2f})"


def _prediction(p: dict[str, Any] | None) -> str:
    """kvroute's own check of its predictions: mean |predicted - engine| and the miss share."""
    if not p or not p.get("verified"):
        return "-"
    return f"{p['mean_abs_error_tokens']} ({p['misses'] / p['verified']:.0%} missed)"


def routing_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The routing benchmark's table: one row per router that ran."""
    headers = [
        "router",
        "cached tokens",
        "cached %",
        "vs oracle",
        "TTFT p50 (s)",
        "TTFT p90 (s)",
        "TTFT p99 (s)",
        "req/s",
        "output tok/s",
        f"goodput req/s (TTFT ≤ {result.get('slo_ttft_s', '?')} s)",
        "GPU s (max/mean)",
        "prediction error (tok)",
        "errors",
    ]
    oracle = next(
        (r for r in result["routers"] if r["name"] == "oracle" and r["status"] == "ok"), None
    )
    rows = []
    for r in result["routers"]:
        if r["status"] != "ok":
            reason = str(r.get("reason", "")).splitlines()[0][:120] if r.get("reason") else ""
            rows.append([r["label"], f"*{r['status']}: {reason}*"] + [""] * 11)
            continue
        s = r["summary"]
        cached = r.get("engine_cached_tokens", s["cached_tokens"])
        prompt = r.get("engine_prompt_tokens") or s["prompt_tokens"]
        vs = None
        if oracle is not None:
            o = oracle.get("engine_cached_tokens", oracle["summary"]["cached_tokens"])
            vs = cached / o if o else None
        rows.append(
            [
                r["label"],
                f"{cached:,}",
                fmt(cached / prompt if prompt else None, pct=True),
                fmt(vs, pct=True),
                fmt(s["ttft_p50"]),
                fmt(s["ttft_p90"]),
                fmt(s["ttft_p99"]),
                fmt(s["req_per_s"], 2),
                fmt(s["output_tok_per_s"], 0),
                fmt(s["goodput_req_per_s"], 2),
                _busy(r.get("per_engine_busy_s")),
                _prediction(r.get("prediction")),
                str(s["errors"]),
            ]
        )
    return headers, rows


def pd_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """A prefill/decode run's table: per router that ran, the time per output token, what
    each pool served from its own cache, and the KV the decode engines pulled."""
    headers = [
        "router",
        "TTFT p50 (s)",
        "TTFT p99 (s)",
        "TPOT p50 (ms)",
        "TPOT p99 (ms)",
        "prefill pool cached %",
        "decode pool cached %",
        "pulls per request",
        "blocks pulled per request",
        "failed pulls",
        "GPU s prefill / decode",
        "errors",
    ]
    rows = []
    for r in result["routers"]:
        pd, s = r.get("pd"), r.get("summary")
        if r["status"] != "ok" or not pd or not s:
            continue
        pre, dec = pd["prefill"], pd["decode"]
        rows.append(
            [
                r["label"],
                fmt(s["ttft_p50"]),
                fmt(s["ttft_p99"]),
                _ms_cell(s.get("tpot_p50")),
                _ms_cell(s.get("tpot_p99")),
                fmt(pre["cached_ratio"], pct=True),
                fmt(dec["cached_ratio"], pct=True),
                fmt(pd["kv_pulls_per_request"], 2),
                fmt(pd["kv_blocks_per_request"], 1),
                fmt(pd.get("kv_pull_failures")),
                f"{pre['busy_s']:.1f} / {dec['busy_s']:.1f}",
                str(s["errors"]),
            ]
        )
    return headers, rows


def _pd_lines(result: dict[str, Any]) -> list[str]:
    headers, rows = pd_rows(result)
    if not rows:
        return []
    return [
        "",
        "Prefill/decode: each pool's prompt tokens its engines found in their own prefix cache "
        "(a decode engine pulls only the blocks it lacks), the decode engines' pulls from a "
        "prefill engine and the 16-token KV blocks they moved, per answered request, and the "
        "pulls that brought nothing (the decode then computed the prompt).",
        "",
        markdown_table(headers, rows),
    ]


def engines_label(fleet: dict[str, Any]) -> str:
    """ "4 simulated engines", or "2 prefill + 2 decode simulated engines" for a P/D fleet."""
    pd = fleet.get("pd")
    if pd:
        return f"{pd[0]} prefill + {pd[1]} decode simulated engines"
    return f"{fleet.get('workers', '?')} simulated engines"


def routing_markdown(result: dict[str, Any]) -> str:
    headers, rows = routing_rows(result)
    t = result.get("trace", {})
    f = result.get("fleet", {})
    lines = [
        f"# Routing benchmark: profile `{result['profile']}`"
        + (" on vLLM's KVCacheManager" if f.get("cache_backend") == "vllm" else "")
        + (" (smoke)" if result.get("smoke") else ""),
        "",
        f"Fleet: {engines_label(f)} ({f.get('profile', '?')}, cache "
        f"backend {f.get('cache_backend', 'sim')}), "
        f"trace: {t.get('name', '?')} ({t.get('requests', '?')} requests, "
        f"{t.get('prompt_tokens', 0):,} prompt tokens), replay: {result.get('replay', '?')}. "
        f"Cached tokens are the engines' own count (prefix-cache hits).",
        "",
        markdown_table(headers, rows),
    ]
    lines += _pd_lines(result)
    lines += _ttft_parts_lines(result)
    notes = list(result.get("notes") or [])
    loads = [x for r in result["routers"] for x in r.get("loadavg_1m") or []]
    if loads:
        notes.append(
            f"Machine load average (1 min) around the runs: {min(loads):.1f}-{max(loads):.1f} "
            f"on {result.get('machine', {}).get('cpus', '?')} CPUs shared with other work; "
            "TTFT includes that contention, so small TTFT differences are noise."
        )
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    lines += ["", f"Command: `{result.get('command', '')}`", ""]
    return "\n".join(lines)


def _ttft_parts_lines(result: dict[str, Any]) -> list[str]:
    """Where each router's requests spent their time before the first token (medians), when
    the engines reported their timing; nothing otherwise."""
    runs = [r for r in result["routers"] if r.get("summary", {}).get("ttft_parts_p50")]
    if not runs:
        return []
    heads = ["router", *TTFT_PART_LABELS]
    rows = [
        [r["label"], *(_ms_cell(r["summary"]["ttft_parts_p50"].get(k)) for k in TTFT_PARTS)]
        for r in runs
    ]
    pd = (
        ' In a prefill/decode run the engine is the decode engine: "to the engine" holds the '
        "whole prefill phase (the prefill engine's work and the router's hops to it and back)."
        if (result.get("fleet") or {}).get("pd")
        else ""
    )
    return [
        "",
        "Where the time to first token went (median of each part, ms; the engines stamp when "
        "they receive a request's headers, queue it, admit it and emit its first token). "
        '"To the engine" is the router\'s forward hop; "back to client" its relay of the '
        "first token." + pd,
        "",
        markdown_table(heads, rows),
    ]


def _ms_cell(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.2f}"


def routing_plot(result: dict[str, Any], path: str | Path) -> None:
    """Four panels: cached %, TTFT percentiles, throughput, goodput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["routers"] if r["status"] == "ok"]
    labels = [r["label"] for r in runs]
    x = list(range(len(runs)))

    def cached_pct(r: dict[str, Any]) -> float:
        s = r["summary"]
        cached = r.get("engine_cached_tokens", s["cached_tokens"])
        prompt = r.get("engine_prompt_tokens") or s["prompt_tokens"]
        return 100.0 * cached / prompt if prompt else 0.0

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    ax = axes[0][0]
    ax.bar(x, [cached_pct(r) for r in runs], color="tab:green")
    ax.set_title("prompt tokens served from cache (%)")
    ax = axes[0][1]
    w = 0.27
    for k, (q, color) in enumerate(
        [("ttft_p50", "tab:blue"), ("ttft_p90", "tab:orange"), ("ttft_p99", "tab:red")]
    ):
        ax.bar(
            [i + (k - 1) * w for i in x],
            [r["summary"][q] or 0.0 for r in runs],
            w,
            label=q.replace("ttft_", ""),
            color=color,
        )
    ax.set_title("time to first token (s, log scale)")
    ax.set_yscale("log")
    ax.legend()
    ax = axes[1][0]
    ax.bar(x, [r["summary"]["output_tok_per_s"] for r in runs], color="tab:purple")
    ax.set_title("output tokens / s")
    ax = axes[1][1]
    ax.bar(x, [r["summary"]["goodput_req_per_s"] for r in runs], color="tab:cyan")
    ax.set_title(f"goodput: requests / s with TTFT ≤ {result.get('slo_ttft_s')} s")
    for row in axes:
        for a in row:
            a.set_xticks(x)
            a.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
            a.grid(axis="y", alpha=0.3)
    fig.suptitle(
        f"kvroute routing benchmark, profile {result['profile']}"
        + (" (smoke)" if result.get("smoke") else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def index_plot(result: dict[str, Any], path: str | Path) -> None:
    """Benchmark 3: score time against prompt length (a line per fleet size, hot and cold, one
    panel per layout) and memory per (worker, group, block) entry."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = sorted({r["layout"] for r in result["score"]})
    fig, axes = plt.subplots(1, len(layouts) + 1, figsize=(5.2 * (len(layouts) + 1), 4.6))
    for ax, layout in zip(axes, layouts, strict=False):
        rows = [r for r in result["score"] if r["layout"] == layout]
        for workers in sorted({r["workers"] for r in rows}):
            pts = sorted((r["prompt_tokens"], r) for r in rows if r["workers"] == workers)
            xs = [t for t, _ in pts]
            (line,) = ax.plot(xs, [r["hot"]["median_ms"] for _, r in pts], marker="o",
                              label=f"{workers} workers")  # fmt: skip
            ax.plot(xs, [r["cold"]["median_ms"] for _, r in pts], linestyle=":",
                    color=line.get_color())  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("score time, median (ms)")
        ax.set_title(f"{layout} layout: hot (solid), cold (dotted)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[-1]
    mem = result.get("memory", [])
    ax.bar(range(len(mem)), [m["bytes_per_entry"] for m in mem], color="tab:green")
    ax.set_xticks(range(len(mem)))
    ax.set_xticklabels(
        [f"{m['layout']}\n{m['workers']} workers\n{m['entries']:,} entries" for m in mem],
        fontsize=8,
    )
    ax.set_ylabel("bytes per (worker, group, block) entry")
    ax.set_title("index memory")
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle("kvroute index benchmark (" + str(result.get("machine", "")) + ")")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Re-render tables and plots of result files: ``python -m bench.report F.json ...``.

    Routing results get their table and plot; index results (``index*.json``) their plot."""
    import json
    import sys

    paths = list(argv if argv is not None else sys.argv[1:])
    for p in paths:
        result = json.loads(Path(p).read_text())
        if "score" in result and "memory" in result:
            index_plot(result, Path(p).with_suffix(".png"))
            continue
        if result.get("benchmark") != "routing":
            print(f"{p}: not a routing result, skipped", file=sys.stderr)
            continue
        Path(p).with_suffix(".md").write_text(routing_markdown(result))
        routing_plot(result, Path(p).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
