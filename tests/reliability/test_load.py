"""Load through one router process in front of fast simulated engines (real processes): many
concurrent streams with zero lost or corrupted responses and bounded router memory, and a
short soak with churned caches. The heavy versions are in bench/reliability_bench.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from bench.loopback import Loopback
from bench.reliability_bench import Expected, Outcome, burst, prompts, sustained
from bench.traffic import metric, metrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(100)
def test_concurrent_streams_and_a_soak_lose_nothing() -> None:
    async def main(lb: Loopback) -> None:
        # small KV pools: the soak's new documents keep evicting (churned caches)
        args = ("--speed", "1000", "--max-num-seqs", "1024", "--num-blocks", "1024")
        engines = lb.engines(2, *args)
        bridges = lb.bridges(engines)
        reference = lb.engine("reference", *args)  # same model, outside the fleet
        router = lb.router(lb.router_config(engines, bridges))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            texts = Expected(http, reference, 16)
            pool = prompts(1, 40, 40)
            warm, _ = await burst(http, router.url, texts, pool, 100, 16)
            assert warm.intact == 100, warm
            rss_before = router.proc.rss_bytes()
            first, _ = await burst(http, router.url, texts, pool, 400, 16)
            rss_first = router.proc.rss_bytes()
            second, _ = await burst(http, router.url, texts, pool, 400, 16)
            rss_second = router.proc.rss_bytes()
            for out in (first, second):
                assert out.intact == 400 and out.lost == 0 and out.reported == 0, out
            # memory: a second identical round does not grow the router (no per-request leak)
            assert rss_second - rss_first < 16 * 2**20, (rss_before, rss_first, rss_second)
            assert rss_second - rss_before < 64 * 2**20, (rss_before, rss_first, rss_second)

            soak = Outcome()
            await sustained(http, router.url, texts, 3.0, 16, 16, 7, soak)
            assert soak.sent >= 100 and soak.intact == soak.sent, soak
            page = await metrics(http, router.url)
            assert metric(page, "kvroute_requests_total", status="200") >= 1000
            assert metric(page, "kvroute_errors_total") == 0
            # churn: the engines evicted, and the router's view followed (removes applied)
            for b in bridges:
                bp = await metrics(http, b.http_url)
                assert metric(bp, "kvroute_bridge_events_total", kind="remove") > 0

    with Loopback() as lb:
        asyncio.run(main(lb))


@pytest.mark.timeout(90)
def test_reliability_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "reliability.json"
    subprocess.run(
        [sys.executable, "-m", "bench.reliability_bench", "--smoke", "--out", str(out)],
        cwd=ROOT,
        check=True,
        timeout=80,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert summary["requests_lost"] == 0 and summary["fuzz_failures"] == 0, summary
    assert summary["inputs_tried"] > 0 and result["faults"]["survived"] == result["faults"]["of"]
