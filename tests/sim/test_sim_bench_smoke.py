"""bench/sim_engine.py --smoke runs and writes its result file."""

from __future__ import annotations

import json
from pathlib import Path

from bench.sim_engine import main


def test_sim_engine_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "sim_engine.json"
    assert main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["smoke"] is True
    assert {row["profile"] for row in result["core"]} == {"dense", "swa", "mamba"}
    assert all(row["requests_per_s"] > 0 for row in result["core"])
    assert result["http"]["requests_per_s"] > 0
