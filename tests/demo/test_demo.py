"""`kvroute demo --short`: the whole pipeline on real processes, and its small parts.

The short run starts two fresh simulated fleets (engines + bridges) and the router on
loopback, replays the built-in workload under round robin and under kvroute, and compares
what the engines reported. Nothing is mocked.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvroute.demo.cli import Progress, build_parser, parse_policies, run_demo
from kvroute.demo.run import prediction_from_metrics
from kvroute.testbed.stats import RequestRecord


@pytest.mark.timeout(240)
def test_short_demo_cache_aware_reuses_more_than_round_robin(tmp_path: Path) -> None:
    args = build_parser().parse_args(["--short", "--out", str(tmp_path)])
    out, err = io.StringIO(), io.StringIO()
    outcome = run_demo(args, out, err)
    assert outcome.live is None  # nothing left running without --keep
    runs = {r.policy: r for r in outcome.runs}
    assert set(runs) == {"kvroute", "round_robin"}
    aware, rr = runs["kvroute"], runs["round_robin"]
    for r in (aware, rr):
        assert r.summary["errors"] == 0, r.summary["error_kinds"]
        assert r.summary["ok"] == r.summary["requests"] > 0
    # Same trace, so the same prompt tokens; the engines' own numbers decide.
    assert aware.summary["prompt_tokens"] == rr.summary["prompt_tokens"]
    assert aware.summary["cached_tokens"] > rr.summary["cached_tokens"]
    assert aware.engine["engine_cached_tokens"] > rr.engine["engine_cached_tokens"]

    # The router checked its predictions against the engines, and they were mostly exact.
    p = aware.prediction
    assert p is not None and p["verified"] > 0
    assert p["exact"] >= 0.8 * p["verified"]
    # After the traffic, kvroute's view matches every engine's true hit; a full-attention-only
    # view of this hybrid (sliding-window) model overstates some.
    h = aware.hybrid
    assert h is not None and h["pairs"] > 0
    assert h["kvroute_exact_share"] >= 0.9
    assert h["full_attention_only_predicted_tokens"] >= h["true_cached_tokens"]

    # Outputs: the table, the JSON and the picture.
    text = out.getvalue()
    assert "kvroute (cache-aware)" in text and "round robin" in text
    assert "kvroute demo --keep" in text
    doc = json.loads(outcome.json_path.read_text())
    assert [r["policy"] for r in doc["runs"]] == ["round_robin", "kvroute"]
    assert doc["runs"][1]["summary"]["cached_tokens"] == aware.summary["cached_tokens"]
    png = outcome.png_path.read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert "requests" in err.getvalue()  # the progress line


_METRICS = """\
# HELP kvroute_prediction_outcomes_total Verified predictions
# TYPE kvroute_prediction_outcomes_total counter
kvroute_prediction_outcomes_total{outcome="exact",worker="a"} 8.0
kvroute_prediction_outcomes_total{outcome="over",worker="b"} 2.0
# HELP kvroute_predicted_cached_tokens_total Sum of predicted
# TYPE kvroute_predicted_cached_tokens_total counter
kvroute_predicted_cached_tokens_total{worker="a"} 800.0
kvroute_predicted_cached_tokens_total{worker="b"} 300.0
# HELP kvroute_reported_cached_tokens_total Sum of reported
# TYPE kvroute_reported_cached_tokens_total counter
kvroute_reported_cached_tokens_total{worker="a"} 800.0
kvroute_reported_cached_tokens_total{worker="b"} 200.0
# HELP kvroute_prediction_error_tokens Absolute difference
# TYPE kvroute_prediction_error_tokens histogram
kvroute_prediction_error_tokens_bucket{le="+Inf",worker="a"} 8.0
kvroute_prediction_error_tokens_sum{worker="a"} 0.0
kvroute_prediction_error_tokens_count{worker="a"} 8.0
kvroute_prediction_error_tokens_bucket{le="+Inf",worker="b"} 2.0
kvroute_prediction_error_tokens_sum{worker="b"} 100.0
kvroute_prediction_error_tokens_count{worker="b"} 2.0
"""


def test_prediction_from_router_metrics() -> None:
    p = prediction_from_metrics(_METRICS)
    assert p is not None
    assert (p["verified"], p["exact"], p["over"], p["under"]) == (10, 8, 2, 0)
    assert (p["predicted_tokens"], p["reported_tokens"]) == (1100, 1000)
    assert p["mean_abs_error_tokens"] == 10.0
    assert p["abs_error_share"] == 0.1
    assert prediction_from_metrics("") is None  # a router that checked nothing


def test_progress_prints_quarters_when_not_a_terminal() -> None:
    stream = io.StringIO()
    progress = Progress("round robin", 8, stream)
    for i in range(8):
        rec = RequestRecord(id=str(i), session="s", kind="chat", scheduled=0.0)
        rec.status, rec.prompt_tokens, rec.cached_tokens = 200, 100, 50 if i % 2 else 0
        if i == 3:
            rec.error = "timeout"
        progress(rec)
    progress.finish()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4
    assert "8/8 requests" in lines[-1] and "errors 1" in lines[-1]
    assert "cached 21.4%" in lines[-1]  # 3 of the 7 ok requests reused 50 of their 100


def test_policies_are_checked() -> None:
    assert parse_policies("round_robin, kvroute") == ["round_robin", "kvroute"]
    for bad in ("", "kvroute,least_load", ","):
        with pytest.raises(ValueError):
            parse_policies(bad)


@pytest.mark.timeout(180)
def test_keep_leaves_router_and_dashboard_up_until_ctrl_c(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "kvroute", "demo", "--short", "--keep"]
    cmd += ["--policies", "kvroute", "--out", str(tmp_path)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        dashboard = None
        deadline = time.monotonic() + 150
        while dashboard is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            found = re.search(r"dashboard\s+(http://127\.0\.0\.1:\d+)/dashboard#token=(\S+)", line)
            if found:
                dashboard = found
        assert dashboard is not None, "no dashboard URL printed"
        url, token = dashboard.group(1), dashboard.group(2)
        assert httpx.get(f"{url}/dashboard", timeout=5.0).status_code == 200
        workers = httpx.get(
            f"{url}/admin/workers", headers={"authorization": f"Bearer {token}"}, timeout=5.0
        ).json()["workers"]
        assert len(workers) == 2 and all(w["status"] == "ready" for w in workers)
        # The caches are warm from the run.
        assert all(sum(w["index"]["blocks_per_group"].values()) > 0 for w in workers)

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=2.0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
