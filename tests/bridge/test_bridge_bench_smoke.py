"""The bridge benchmark runs in --smoke mode and writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path

from bench import bridge_bench


def test_bridge_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bridge.json"
    assert bridge_bench.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["smoke"] is True
    assert {r["workload"] for r in result["throughput"]} == {
        "prefill",
        "hybrid",
        "decode",
        "decode-8",
        "prefill-0.23",
    }
    assert all(r["decode_convert_blocks_per_s"] > 0 for r in result["throughput"])
    assert all(m["bytes_per_block"] > 0 for m in result["memory"])
