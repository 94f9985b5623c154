"""The indexer benchmark's --smoke mode runs and writes its results."""

from __future__ import annotations

import json
from pathlib import Path

from bench import index_bench


def test_index_bench_smoke(tmp_path: Path) -> None:
    assert index_bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "index-smoke.json").read_text())
    assert {r["layout"] for r in result["score"]} == {"full", "hybrid"}
    for row in result["score"]:
        assert row["hot"]["median_ms"] > 0 and row["best_hit"] > 0
    assert [r["prompt_tokens"] for r in result["sharing"]] == [1024, 8192]
    for row in result["sharing"]:
        assert row["note"]["median_ms"] > 0 and row["own_from"]["median_ms"] > 0
    assert all(r["rate"] > 0 for r in result["ingest"])
    assert all(0 < r["bytes_per_entry"] < 10_000 for r in result["memory"])
    assert "| layout |" in (tmp_path / "index-smoke.md").read_text()
    png = (tmp_path / "index-smoke.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
