"""Which async HTTP client should the proxy use upstream? aiohttp, httpx and the router's own
lean HTTP/1.1 client (kvroute/router/edge/http1.py), side by side.

Both clients talk to the same instant engine (its own process) through pooled keep-alive
connections, with the same request body, at concurrency 1 and 64, non-streaming and
streaming (SSE read chunk by chunk). Per cell: latency median and p99, throughput, and the
client process's CPU time per request (what the proxy would spend).

    python -m bench.http_client_bench [--requests 4000] [--smoke]

Writes bench/results/http_client_bench.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import uvloop

from bench.instant_engine import running_engine

RESULTS = Path(__file__).resolve().parent / "results"
BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "x" * 1000}], "max_tokens": 8}
).encode()
STREAM_BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "x" * 1000}], "stream": True}
).encode()
HEADERS = {"content-type": "application/json"}

OneCall = Callable[[bytes, bool], Awaitable[None]]


async def _drive(call: OneCall, concurrency: int, total: int, stream: bool) -> dict[str, float]:
    body = STREAM_BODY if stream else BODY
    for _ in range(min(200, total)):  # warm the pool
        await call(body, stream)
    latencies: list[float] = []
    remaining = total

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter()
            await call(body, stream)
            latencies.append(time.perf_counter() - t0)

    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    latencies.sort()
    return {
        "median_us": statistics.median(latencies) * 1e6,
        "p99_us": latencies[int(0.99 * (len(latencies) - 1))] * 1e6,
        "req_per_s": len(latencies) / wall,
        "cpu_us_per_req": cpu / len(latencies) * 1e6,
    }


async def bench_aiohttp(url: str, concurrency: int, total: int, stream: bool) -> dict[str, float]:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:

        async def call(body: bytes, stream: bool) -> None:
            async with session.post(url, data=body, headers=HEADERS) as resp:
                if stream:
                    while await resp.content.readany():
                        pass
                else:
                    await resp.read()

        return await _drive(call, concurrency, total, stream)


async def bench_httpx(url: str, concurrency: int, total: int, stream: bool) -> dict[str, float]:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:

        async def call(body: bytes, stream: bool) -> None:
            if stream:
                async with client.stream("POST", url, content=body, headers=HEADERS) as resp:
                    async for _ in resp.aiter_raw():
                        pass
            else:
                resp = await client.post(url, content=body, headers=HEADERS)
                _ = resp.content

        return await _drive(call, concurrency, total, stream)


async def bench_http1(url: str, concurrency: int, total: int, stream: bool) -> dict[str, float]:
    from kvroute.router.edge.http1 import Http1Pool

    pool = Http1Pool(limit=1024, connect_s=3.0, read_idle_s=600.0)
    headers = list(HEADERS.items())

    async def call(body: bytes, stream: bool) -> None:
        resp = await pool.request("POST", url, headers, body)
        if stream:
            while await resp.next_chunk():
                pass
        else:
            await resp.read()
        resp.release()

    try:
        return await _drive(call, concurrency, total, stream)
    finally:
        await pool.close()


CLIENTS = {"aiohttp": bench_aiohttp, "httpx": bench_httpx, "kvroute-http1": bench_http1}


def run(total: int, smoke: bool) -> dict[str, Any]:
    cells: list[dict[str, Any]] = []
    with running_engine() as base:
        url = base + "/v1/chat/completions"
        for stream in (False, True):
            for concurrency in (1, 64):
                for name, fn in CLIENTS.items():
                    got = uvloop.run(fn(url, concurrency, total, stream))
                    cell = {"client": name, "stream": stream, "concurrency": concurrency, **got}
                    cells.append(cell)
                    print(
                        f"{name:14s} stream={stream!s:5s} c={concurrency:<3d} "
                        f"median {got['median_us']:8.0f} us  p99 {got['p99_us']:8.0f} us  "
                        f"{got['req_per_s']:8.0f} req/s  cpu {got['cpu_us_per_req']:6.0f} us/req",
                        flush=True,
                    )
    wins = {
        name: sum(
            1
            for c in cells
            if c["client"] == name
            and c["cpu_us_per_req"] <= min(o["cpu_us_per_req"] for o in cells if _same_cell(o, c))
        )
        for name in CLIENTS
    }
    chosen = max(wins, key=lambda n: wins[n])
    return {
        "benchmark": "http_client",
        "smoke": smoke,
        "requests_per_cell": total,
        "cells": cells,
        "cpu_wins": wins,
        "chosen": chosen,
        "command": "python -m bench.http_client_bench" + (" --smoke" if smoke else ""),
    }


def _same_cell(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["stream"] == b["stream"] and a["concurrency"] == b["concurrency"]


def to_markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Upstream HTTP client: aiohttp vs httpx vs kvroute's own HTTP/1.1 client",
        "",
        f"`{result['command']}` ({result['requests_per_cell']} requests per cell, instant "
        "engine in its own process, pooled keep-alive connections, uvloop).",
        "",
        "| client | stream | concurrency | median µs | p99 µs | req/s | client CPU µs/req |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in result["cells"]:
        lines.append(
            f"| {c['client']} | {c['stream']} | {c['concurrency']} | {c['median_us']:.0f} | "
            f"{c['p99_us']:.0f} | {c['req_per_s']:.0f} | {c['cpu_us_per_req']:.0f} |"
        )
    lines += [
        "",
        f"Chosen for the router's upstream: **{result['chosen']}** (lowest client CPU per "
        f"request in {result['cpu_wins'][result['chosen']]} of "
        f"{len(result['cells']) // len(CLIENTS)} "
        "cells; CPU per request is what bounds a proxy's added latency under load).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=4000, help="requests per cell")
    p.add_argument("--smoke", action="store_true", help="a few hundred requests per cell")
    p.add_argument("--out", default=str(RESULTS), help="results directory")
    args = p.parse_args(argv)
    total = 100 if args.smoke else args.requests
    result = run(total, args.smoke)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "http_client_bench" + ("_smoke" if args.smoke else "")
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{stem}.md").write_text(to_markdown(result))
    print(f"chosen: {result['chosen']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
