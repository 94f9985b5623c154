"""Benchmark 2: what a router adds, kvroute side by side with smg and vllm-router.

Four instant engines (``bench.instant_engine``, the router helper's: vLLM's response shapes,
no work) each in its own process. The same aiohttp client sends the same chat request
(about 1,000 tokens of text) directly to the engines (spread round robin: the baseline) and
through each router, non-streaming and streaming, with 1, 64 and 512 concurrent clients.
Each router does its real per-request work: kvroute tokenizes with the model directory's
chat template and scores the index; smg's cache_aware walks its text tree; vllm-router's
cache_aware asks every engine to render and tokenize.

Per cell: latency median / p99 (ms), added latency versus direct, requests per second (the
maximum rate at that concurrency, since the client never waits), errors.

``python -m bench.overhead_bench [--smoke] [--routers ...] [--requests N]``
writes ``bench/results/overhead.{json,md,png}`` (smoke: ``overhead_smoke.*``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.report import fmt, markdown_table
from kvroute.testbed.peers import find_peers
from kvroute.testbed.procs import ProcessGroup, free_port
from kvroute.testbed.stats import percentile
from kvroute.testbed.textgen import TokenSpace

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "m"  # the instant engine's model name
ENGINES = 4


@dataclass(frozen=True)
class Target:
    name: str
    label: str
    kind: str  # direct | kvroute | smg | vllm-router
    policy: str = ""


TARGETS = {
    t.name: t
    for t in [
        Target("direct", "direct to the engines", "direct"),
        Target("kvroute", "kvroute (default)", "kvroute", "ttft"),
        Target("kvroute-round-robin", "kvroute round_robin", "kvroute", "round_robin"),
        Target("smg-cache-aware", "smg cache_aware", "smg", "cache_aware"),
        Target("smg-round-robin", "smg round_robin", "smg", "round_robin"),
        Target("vllm-router", "vllm-router cache_aware", "vllm-router", "cache_aware"),
        Target("vllm-router-round-robin", "vllm-router round_robin", "vllm-router", "round_robin"),
    ]
}
FULL = tuple(TARGETS)
SMOKE = ("direct", "kvroute")


def _engine_urls(pg: ProcessGroup, n: int) -> list[str]:
    urls = []
    for i in range(n):
        port = free_port()
        child = pg.start(
            f"engine-{i}",
            [sys.executable, "-m", "bench.instant_engine", "--port", str(port), "--chunks", "16"],
        )
        deadline = time.monotonic() + 20
        while "PORT" not in child.log.read_text():
            if child.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"instant engine did not start:\n{child.tail()}")
            time.sleep(0.05)
        urls.append(f"http://127.0.0.1:{port}")
    return urls


def _router_cmd(t: Target, port: int, urls: list[str], run_dir: Path) -> list[str]:
    peers = find_peers()
    if t.kind == "kvroute":
        from kvroute.sim.model import MODEL_DIR

        config = {
            "workers": [{"name": f"e{i}", "url": u, "model": MODEL} for i, u in enumerate(urls)],
            "models": {MODEL: {"tokenizer": str(MODEL_DIR)}},
            "log_level": "warning",
        }
        path = run_dir / f"kvroute-{t.policy}.yaml"
        path.write_text(yaml.safe_dump(config))
        return [sys.executable, "-m", "kvroute", "serve", "--config", str(path),
                "--policy", t.policy, "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    binary = peers.smg if t.kind == "smg" else peers.vllm_router
    if binary is None:
        raise FileNotFoundError(peers.note or f"{t.kind} not installed")
    args = [str(binary)] + (["launch"] if t.kind == "smg" else [])
    return [*args, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
            "--policy", t.policy, "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()),
            "--log-level", "warn" if t.kind == "smg" else "warning"]  # fmt: skip


def _ready(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=1.0) as resp:
            return MODEL in resp.read().decode()
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def _target(pg: ProcessGroup, t: Target, urls: list[str], run_dir: Path) -> Iterator[list[str]]:
    """Base URLs the client spreads over: the engines themselves, or the one router."""
    if t.kind == "direct":
        yield urls
        return
    port = free_port()
    child = pg.start(f"router-{t.name}", _router_cmd(t, port, urls, run_dir))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not _ready(url):
        if child.popen.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{t.name} did not start:\n{child.tail()}")
        time.sleep(0.1)
    try:
        yield [url]
    finally:
        pg.stop(child)


async def _load(
    bases: list[str], body: bytes, stream: bool, clients: int, total: int, warmup: int
) -> dict[str, Any]:
    headers = {"content-type": "application/json"}
    latencies: list[float] = []
    errors = 0
    counter = iter(range(10**9))
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def one() -> bool:
            base = bases[next(counter) % len(bases)]
            try:
                async with http.post(
                    base + "/v1/chat/completions", data=body, headers=headers
                ) as r:
                    if stream:
                        while await r.content.readany():
                            pass
                    else:
                        await r.read()
                    return r.status == 200
            except (aiohttp.ClientError, TimeoutError):
                return False

        sem = asyncio.Semaphore(clients)

        async def warm() -> None:
            async with sem:
                await one()

        await asyncio.gather(*(warm() for _ in range(warmup)))
        remaining = total

        async def client() -> None:
            nonlocal remaining, errors
            while remaining > 0:
                remaining -= 1
                t0 = time.perf_counter()
                ok = await one()
                if ok:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {
        "median_ms": round((percentile(latencies, 50) or 0.0) * 1e3, 3),
        "p99_ms": round((percentile(latencies, 99) or 0.0) * 1e3, 3),
        "req_per_s": round(len(latencies) / wall, 1) if wall > 0 else 0.0,
        "ok": len(latencies),
        "errors": errors,
    }


def request_body(stream: bool) -> bytes:
    """A chat request with ~1,000 tokens of text (same for every target)."""
    space = TokenSpace.discover()
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": space.content(("overhead", "system"), 800)},
            {"role": "user", "content": space.content(("overhead", "user"), 200)},
        ],
        "max_tokens": 16,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


def run(
    targets: Sequence[str], concurrency: Sequence[int], requests: int, run_dir: Path
) -> list[dict[str, Any]]:
    cells: list[dict[str, Any]] = []
    with ProcessGroup(run_dir / "logs") as pg:
        urls = _engine_urls(pg, ENGINES)
        for name in targets:
            t = TARGETS[name]
            try:
                ctx = _target(pg, t, urls, run_dir)
                bases = ctx.__enter__()
            except (RuntimeError, FileNotFoundError, subprocess.SubprocessError) as exc:
                cells.append({"target": name, "status": "unavailable", "reason": str(exc)[:500]})
                print(f"{name}: unavailable: {exc}", file=sys.stderr)
                continue
            try:
                for stream in (False, True):
                    body = request_body(stream)
                    for c in concurrency:
                        total = max(requests, 4 * c) if c > 1 else max(200, requests // 5)
                        res = asyncio.run(_load(bases, body, stream, c, total, min(200, total)))
                        cell = {"target": name, "status": "ok", "stream": stream, "clients": c,
                                "requests": total, **res}  # fmt: skip
                        cells.append(cell)
                        print(
                            f"{name:24s} stream={stream!s:5s} c={c:<3d} median "
                            f"{res['median_ms']:.2f} ms p99 {res['p99_ms']:.2f} ms "
                            f"{res['req_per_s']:.0f} req/s errors {res['errors']}",
                            file=sys.stderr,
                            flush=True,
                        )
            finally:
                ctx.__exit__(None, None, None)
    return cells


def with_added(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adds added_median_ms / added_p99_ms versus the direct cell of the same setting."""
    direct = {
        (c["stream"], c["clients"]): c for c in cells if c["target"] == "direct" and "stream" in c
    }
    for c in cells:
        d = direct.get((c.get("stream"), c.get("clients")))
        if d is not None and c["status"] == "ok":
            c["added_median_ms"] = round(c["median_ms"] - d["median_ms"], 3)
            c["added_p99_ms"] = round(c["p99_ms"] - d["p99_ms"], 3)
    return cells


def to_markdown(result: dict[str, Any]) -> str:
    headers = ["target", "stream", "clients", "median ms", "p99 ms", "added median ms",
               "added p99 ms", "req/s", "errors"]  # fmt: skip
    rows = []
    for c in result["cells"]:
        label = TARGETS[c["target"]].label
        if c["status"] != "ok":
            rows.append([label, f"*{c['status']}: {c.get('reason', '')[:80]}*"] + [""] * 7)
            continue
        rows.append(
            [label, "yes" if c["stream"] else "no", str(c["clients"]), fmt(c["median_ms"], 2),
             fmt(c["p99_ms"], 2), fmt(c.get("added_median_ms"), 2), fmt(c.get("added_p99_ms"), 2),
             fmt(c["req_per_s"], 0), str(c["errors"])]
        )  # fmt: skip
    lines = [
        "# Router overhead" + (" (smoke)" if result["smoke"] else ""),
        "",
        f"{ENGINES} instant engines (no work, vLLM response shapes), one aiohttp client process; "
        "the same chat request (~1,000 tokens of text, 16 SSE content events when streaming). "
        "`direct` spreads the requests over the engines itself. Added = router minus direct "
        f"at the same setting. Machine: {result['machine']['cpus']} CPUs shared by the client, "
        "the router and the engines (and, on this machine, other work), so high-concurrency "
        "cells include CPU contention.",
        "",
        markdown_table(headers, rows),
        "",
        f"Command: `{result['command']}`",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [c for c in result["cells"] if c["status"] == "ok"]
    names = [n for n in TARGETS if any(c["target"] == n for c in ok)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    for stream, ax in ((False, axes[0]), (True, axes[1])):
        for n in names:
            if n == "direct":
                continue
            pts = sorted(
                (c["clients"], c.get("added_median_ms", 0.0))
                for c in ok
                if c["target"] == n and c["stream"] == stream
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=TARGETS[n].label)
        ax.set_xscale("log")
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("added median latency (ms)")
        ax.set_title("streaming" if stream else "non-streaming")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    ax = axes[2]
    top = max((c["clients"] for c in ok), default=1)
    vals = [
        max((c["req_per_s"] for c in ok if c["target"] == n and c["clients"] == top), default=0)
        for n in names
    ]
    ax.bar(range(len(names)), vals, color="tab:blue")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([TARGETS[n].label for n in names], rotation=30, ha="right", fontsize=7)
    ax.set_title(f"max requests/s at {top} clients")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overhead_bench", description=__doc__)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--routers", default=None, help=f"comma list of {list(TARGETS)}")
    p.add_argument("--requests", type=int, default=3000, help="requests per cell")
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    targets = tuple(args.routers.split(",")) if args.routers else (SMOKE if args.smoke else FULL)
    if "direct" not in targets:
        targets = ("direct", *targets)
    concurrency = (1, 16) if args.smoke else (1, 64, 512)
    requests = 150 if args.smoke else args.requests
    out = Path(args.out_dir)
    stem = "overhead" + ("_smoke" if args.smoke else "")
    run_dir = out / "runs" / stem
    run_dir.mkdir(parents=True, exist_ok=True)
    cells = with_added(run(targets, concurrency, requests, run_dir))
    result = {
        "benchmark": "overhead",
        "smoke": args.smoke,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": "python -m bench.overhead_bench "
        + shlex.join(list(argv) if argv is not None else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "engines": ENGINES,
        "cells": cells,
    }
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{stem}.md").write_text(to_markdown(result))
    plot(result, out / f"{stem}.png")
    print(to_markdown(result))
    bad = [c for c in cells if c["status"] == "ok" and c["errors"]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
