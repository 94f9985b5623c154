"""Benchmark 2 in smoke mode: instant engines, kvroute, the same client; real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_overhead_smoke_measures_direct_and_kvroute(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.overhead_bench", "--smoke", "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "overhead_smoke.json").read_text())
    cells = result["cells"]
    for target in ("direct", "kvroute"):
        mine = [c for c in cells if c["target"] == target]
        assert {(c["stream"], c["clients"]) for c in mine} == {
            (s, n) for s in (False, True) for n in (1, 16)
        }
        for c in mine:
            assert c["status"] == "ok" and c["errors"] == 0 and c["ok"] == c["requests"]
            assert 0 < c["median_ms"] <= c["p99_ms"] and c["req_per_s"] > 0
            # Added latency is router minus direct at the same setting (0 for direct).
            assert "added_median_ms" in c
    assert all(c["added_median_ms"] == 0 for c in cells if c["target"] == "direct")
    assert "| kvroute (default) |" in (tmp_path / "overhead_smoke.md").read_text()
    assert (tmp_path / "overhead_smoke.png").stat().st_size > 0
