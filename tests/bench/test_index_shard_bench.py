"""The index shard bench's gRPC feed (real shard processes following a bench bridge) and the
probe's analysis of where a shard's queries wait."""

from __future__ import annotations

import json
from pathlib import Path

from bench import index_shard_bench, index_shard_probe


def test_the_grpc_feed_reaches_the_shards_through_their_subscriptions(tmp_path: Path) -> None:
    assert (
        index_shard_bench.main(
            ["--smoke", "--via", "grpc", "--workers", "16", "--out", str(tmp_path)]
        )
        == 0
    )
    result = json.loads((tmp_path / "index_shards.json").read_text())
    (row,) = result["fleets"][0]["rows"]
    assert row["via"] == "grpc" and row["feed_blocks_per_s"] > 0
    assert row["lag_ms"]["batches"] > 0 and row["feed_overflows"] == 0  # applied, lag observed
    assert "| grpc |" in (tmp_path / "index_shards.md").read_text()


def test_the_probe_counts_the_batches_applied_while_a_query_waited(tmp_path: Path) -> None:
    # the router sent at 10.0 and 20.0; shard 0 applied 3 batches before answering the first
    # at 10.005, and answered the second at once
    router = {"q": [[10.0, 10.006], [20.0, 20.0005]], "schedstat": [[0, 0, 0], [2e9, 1e9, 100]]}
    shard = {
        "a": [[10.001, 10.002], [10.002, 10.003], [10.003, 10.0045], [20.5, 20.6]],
        "q": [[10.005, 10.0055], [20.0001, 20.0002], [30.0, 30.001]],  # the last: after the trace
    }
    (tmp_path / "router-1.json").write_text(json.dumps(router))
    (tmp_path / "shard-2.json").write_text(json.dumps(shard))
    out = index_shard_probe.analyse_dir(tmp_path)
    assert out["queries_sent"] == 2 and out["answers"] == 2
    assert out["batches_ahead"]["max"] == 3  # type: ignore[index]
    assert out["answers_waiting_over_2ms"] == 1 and out["of_those_mostly_applying"] == 1
    assert out["cpu_wait"]["router0"]["mean_wait_per_timeslice_ms"] == 10.0  # type: ignore[index]
