"""Benchmark 1 in smoke mode, end to end: real fleet processes, real routers, real requests.

Asserts on measured numbers: the cache-aware router made the engines reuse more prompt
tokens than round robin on the same trace and fleet. And nothing the benchmark started is
left running (every descendant inherits a unique environment tag, found through /proc).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from kvroute.testbed.routers import kvroute_available


def _tagged_pids(tag: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if f"KVROUTE_BENCH_TAG={tag}".encode() in env:
            pids.append(int(entry.name))
    return pids


def test_routing_smoke_cache_aware_beats_round_robin(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "bench.routing_bench", "--smoke", "--profile", "dense",
         "--out-dir", str(tmp_path)],
        env={**os.environ, "KVROUTE_BENCH_TAG": tag},
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )  # fmt: skip
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "routing_dense_smoke.json").read_text())
    rows = {r["name"]: r for r in result["routers"]}
    if kvroute_available() is None:
        aware, rr = rows["kvroute"], rows["kvroute-round-robin"]
    else:  # before the router lands: the bench's own text-prefix proxy
        aware, rr = rows["bench-prefix"], rows["bench-round-robin"]
    for row in (aware, rr):
        assert row["status"] == "ok", row
        assert row["summary"]["errors"] == 0, row["summary"]["error_kinds"]
        assert row["summary"]["ok"] == result["trace"]["requests"]
        assert row["engine_prompt_tokens"] > 0
    # The engines' own counters and the per-request usage agree on who reused more.
    assert aware["engine_cached_tokens"] > rr["engine_cached_tokens"]
    assert aware["summary"]["cached_tokens"] > rr["summary"]["cached_tokens"]
    if kvroute_available() is None:  # every request's decision, in arrival order
        run_dir = tmp_path / "runs" / "routing_dense_smoke"
        lines = (run_dir / "kvroute.decisions.jsonl").read_text().splitlines()
        decisions = [json.loads(line) for line in lines]
        records = [json.loads(line) for line in (run_dir / "kvroute.records.jsonl").open()]
        assert len(decisions) == len(records) == result["trace"]["requests"]
        assert all(d["candidates"] and d["chosen"] for d in decisions)
        sent = sorted(records, key=lambda r: r["sent"])
        pairs = zip(decisions, sent, strict=True)
        same = sum(d["prompt_tokens"] == r["prompt_tokens"] for d, r in pairs)
        assert same > 0.8 * len(sent)  # arrival order is send order, but for near-ties
    assert (tmp_path / "routing_dense_smoke.md").exists()
    assert (tmp_path / "routing_dense_smoke.png").stat().st_size > 0
    assert wall < 90, f"smoke run took {wall:.0f}s"
    deadline = time.monotonic() + 5
    while _tagged_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _tagged_pids(tag) == [], "benchmark left processes running"
