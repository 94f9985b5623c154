"""`kvroute demo --pd --short`: the demo on a prefill/decode fleet, on real processes, and its
small parts.

The short run starts two fresh fleets of two prefill and two decode simulated engines (each
with its bridge) and the router on loopback, replays the built-in workload under round robin
(both halves of a request in turn) and under kvroute, and compares what the engines counted
on each pool. Nothing is mocked.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from kvroute.demo import pd_report
from kvroute.demo.cli import build_parser, main, run_demo
from kvroute.demo.pd import pool_numbers
from kvroute.demo.run import RunResult


@pytest.mark.timeout(300)
def test_short_pd_demo_saves_work_on_both_pools(tmp_path: Path) -> None:
    args = build_parser().parse_args(["--pd", "--short", "--out", str(tmp_path)])
    out, err = io.StringIO(), io.StringIO()
    outcome = run_demo(args, out, err)
    assert outcome.live is None
    runs = {r.policy: r for r in outcome.runs}
    aware, rr = runs["kvroute"], runs["round_robin"]
    for r in (aware, rr):
        assert r.summary["errors"] == 0, r.summary["error_kinds"]
        assert r.summary["ok"] == r.summary["requests"] > 0
        assert r.pd is not None
        # every request was split: one pull by a decode engine each
        assert r.pd["decode"]["pulls"] == r.summary["ok"]
    assert aware.pd is not None and rr.pd is not None
    # the same trace: the prefill pool was given the same prompt tokens in both runs
    assert aware.pd["prefill"]["prompt_tokens"] == rr.pd["prefill"]["prompt_tokens"] > 0
    # what the cache-aware choice bought, by the engines' own counters
    assert aware.pd["prefill"]["computed_tokens"] < rr.pd["prefill"]["computed_tokens"]
    assert aware.pd["decode"]["pulled_tokens"] < rr.pd["decode"]["pulled_tokens"]
    assert aware.pd["decode"]["held_tokens"] > rr.pd["decode"]["held_tokens"]
    # round robin took the decode workers in turn, whatever they held
    pulls = [e["pulls"] for e in rr.pd["per_engine"].values() if e["role"] == "decode"]
    assert len(pulls) == 2 and abs(pulls[0] - pulls[1]) <= 1, pulls

    text = out.getvalue()
    assert "2 prefill and 2 decode simulated vLLM engines" in text
    assert "prefill tokens computed" in text and "tokens pulled / request" in text
    assert "Prefill pool:" in text and "Decode pool:" in text
    assert "kvroute demo --pd --keep" in text
    assert outcome.json_path.name == "demo-pd.json"
    doc = json.loads(outcome.json_path.read_text())
    assert (doc["demo"]["prefill"], doc["demo"]["decode"], doc["demo"]["workers"]) == (2, 2, 0)
    assert [r["policy"] for r in doc["runs"]] == ["round_robin", "kvroute"]
    assert doc["runs"][1]["pools"] == aware.pd
    png = outcome.png_path.read_bytes()
    assert outcome.png_path.name == "demo-pd.png"
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def _state(queries: int, hits: int, busy: float = 0.0, pulled: int | None = None) -> dict[str, Any]:
    state: dict[str, Any] = {
        "groups": [{"block_size": 16}, {"block_size": 16}],
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "busy_seconds": busy,
    }
    if pulled is not None:
        state["kv_transfer"] = {"blocks_pulled": pulled, "pulls": {"ok": pulled // 10}}
    return state


def test_pool_numbers_from_the_engines_counters() -> None:
    roles = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
    before = {
        "p0": _state(100, 50, 1.0),
        "p1": _state(0, 0),
        "d0": _state(10, 0, pulled=10),
        "d1": _state(0, 0, pulled=0),
    }
    after = {
        "p0": _state(1100, 650, 2.5),  # 1,000 prompt tokens, 600 found in cache
        "p1": _state(500, 100, 0.5),
        "d0": _state(810, 300, pulled=40),  # 30 blocks of 16 tokens, 3 pulls
        "d1": _state(700, 400, pulled=20),
    }
    got = pool_numbers(before, after, roles, requests=5)
    assert got["prefill"] == {
        "prompt_tokens": 1500,
        "cached_tokens": 700,
        "computed_tokens": 800,
        "busy_s": 2.0,
        "cached_share": round(700 / 1500, 4),
    }
    assert got["decode"] == {
        "pulled_tokens": 50 * 16,
        "pulled_blocks": 50,
        "held_tokens": 700,
        "pulls": 5,
        "pulled_tokens_per_request": 160.0,
    }
    assert got["per_engine"]["d0"] == {"role": "decode", "pulls": 3, "pulled_blocks": 30}
    assert got["per_engine"]["p1"] == {"role": "prefill", "computed_tokens": 400}


def _run(policy: str, computed: int, pulled: int, ttft: float) -> RunResult:
    pools = {
        "prefill": {"prompt_tokens": 1000, "computed_tokens": computed, "cached_share": 0.5},
        "decode": {"pulled_tokens": pulled, "pulled_tokens_per_request": pulled / 10,
                   "held_tokens": 1000 - pulled},
    }  # fmt: skip
    summary = {"ttft_p50": ttft, "ttft_p99": 2 * ttft}
    return RunResult(policy, policy, summary, {}, None, None, 1.0, pd=pools)


def test_pd_table_and_summary_say_what_each_pool_saved() -> None:
    aware, rr = _run("kvroute", 250, 100, 0.1), _run("round_robin", 500, 400, 0.2)
    table = pd_report.table([rr, aware]).splitlines()
    assert table[0].split("  ")[0] == "policy" and "tokens pulled / request" in table[0]
    assert "250 of 1,000" in table[3] and "10" in table[3].split()
    lines = pd_report.headline(aware, rr)
    assert "computed 250 prompt tokens, round robin 500 (2.00x fewer" in lines[0]
    assert (
        "pulled 10 tokens per request with kvroute, 40 with round robin (4.00x fewer)" in (lines[1])
    )
    assert "2.00x lower (0.100 s vs 0.200 s) at the median" in lines[2]
    with pytest.raises(ValueError):
        pd_report.table([RunResult("x", "x", {}, {}, None, None, 1.0)])  # a mixed fleet's run


def test_pd_takes_no_worker_count(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--pd", "--workers", "3"])
    assert exc.value.code == 2
    assert "--pd runs 2 prefill and 2 decode engines" in capsys.readouterr().err
