"""The pool-pressure benchmark's metrics, report and harness options (no fleet)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from bench.pool_pressure import (
    METRICS,
    conversations,
    later_hit_rate,
    load_runs,
    lost_share,
    main,
    paired_interval,
    report,
)
from bench.routing_bench import (
    build_config,
    parse_args,
    pressure_fleet_args,
)
from kvroute.testbed.workload import live_working_set_tokens


def rec(session: str, turn: int, prompt: int, cached: int, ttft: float = 0.1) -> dict[str, Any]:
    return {
        "id": f"{session}-t{turn:02d}", "session": session, "turn": turn, "sent": float(turn),
        "ttft": ttft, "prompt_tokens": prompt, "cached_tokens": cached, "status": 200,
        "error": None,
    }  # fmt: skip


def test_later_turns_and_lost_history() -> None:
    recs = [
        rec("a", 0, 1000, 0),
        rec("a", 1, 1500, 992),  # within a block of the previous prompt: kept
        rec("a", 2, 2000, 1480),  # 20 short, more than a block: lost
        rec("b", 0, 500, 400),  # a first turn is never later, whatever it found
        {**rec("b", 1, 900, 0), "status": 500, "error": "http 500"},  # unanswered: not counted
        rec("b", 2, 1200, 100),  # follows b's turn 0 (500 tokens): lost
    ]
    convs = conversations(list(reversed(recs)))  # order comes from the turn numbers
    assert [t.later for t in convs["a"]] == [False, True, True]
    assert [t.lost for t in convs["a"]] == [False, False, True]
    assert [t.lost for t in convs["b"]] == [False, True]
    turns = [t for c in convs.values() for t in c]
    assert later_hit_rate(turns) == pytest.approx((992 + 1480 + 100) / (1500 + 2000 + 1200))
    assert lost_share(turns) == pytest.approx(2 / 3)
    assert later_hit_rate(convs["b"][:1]) is None and lost_share([]) is None


def test_a_later_turn_moved_when_its_worker_differs_from_the_previous_answered_turn() -> None:
    recs = [
        {**rec("a", 0, 1000, 0), "worker": "w0"},
        {**rec("a", 1, 1500, 992), "worker": "w0"},
        {**rec("a", 2, 2000, 0), "worker": "w1"},
        {**rec("a", 3, 2500, 0), "status": 500, "error": "http 500", "worker": "w0"},
        {**rec("a", 4, 3000, 1984), "worker": "w1"},  # follows turn 2, on the same worker
    ]
    turns = conversations(recs)["a"]
    assert [t.moved for t in turns] == [False, False, True, False]
    assert [t.lost for t in turns] == [False, False, True, False]


def test_paired_interval_says_lower_only_when_the_interval_excludes_zero() -> None:
    convs_fast = conversations([rec(f"s{i}", 0, 10, 0, 0.1 + i / 1000) for i in range(40)])
    convs_slow = conversations([rec(f"s{i}", 0, 10, 0, 1.0 + i / 1000) for i in range(40)])
    pairs = [(convs_fast[k], convs_slow[k]) for k in convs_fast]
    d = paired_interval(pairs, METRICS["ttft_p90_s"], iterations=200)
    assert d["verdict"] == "lower" and d["diff"] == pytest.approx(-0.9)
    same = paired_interval([(a, a) for a, _ in pairs], METRICS["ttft_p90_s"], iterations=200)
    assert same["verdict"] == "not distinguishable" and same["diff"] == 0


def _write(run_dir: Path, name: str, records: list[dict[str, Any]]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records)
    (run_dir / f"{name}.records.jsonl.gz").write_bytes(gzip.compress(text.encode()))


def test_report_reads_every_seed_and_compares_with_the_reference(tmp_path: Path) -> None:
    for seed in (0, 1):
        run_dir = tmp_path / "seeds" / f"seed{seed}" / "runs" / "routing_dense"
        good = [rec(f"c{i}", t, 1000 * (t + 1), 1000 * t, 0.1) for i in range(30) for t in range(3)]
        bad = [rec(f"c{i}", t, 1000 * (t + 1), 0, 1.0 + t) for i in range(30) for t in range(3)]
        _write(run_dir, "kvroute", good)
        _write(run_dir, "bench-round-robin", bad)
    runs = load_runs(tmp_path, "dense")
    assert set(runs) == {"kvroute", "bench-round-robin"} and len(runs["kvroute"]) == 60
    result = report(runs, "kvroute", iterations=100)
    kv, rr = result["routers"]["kvroute"], result["routers"]["bench-round-robin"]
    assert kv["seeds"] == [0, 1] and kv["requests"] == 180 and kv["later_turns"] == 120
    assert kv["later_hit_rate"]["value"] == pytest.approx((1000 + 2000) / (2000 + 3000))
    assert rr["lost_history"]["value"] == 1.0 and kv["lost_history"]["value"] == 0.0
    paired = result["paired"]["bench-round-robin"]
    assert paired["ttft_p99_s"]["verdict"] == "lower"
    assert paired["later_hit_rate"]["verdict"] == "higher"
    assert main(["--root", str(tmp_path), "--profile", "dense", "--iterations", "50"]) == 0
    md = (tmp_path / "pool_pressure_dense.md").read_text()
    assert "| kvroute | 180 | 0.600" in md and "bench-round-robin" in md
    with pytest.raises(SystemExit):
        main(["--root", str(tmp_path), "--profile", "swa"])


def test_pool_pressure_harness_options() -> None:
    args = parse_args(["--workload", "pool-pressure", "--profile", "dense", "--routers", "oracle"])
    assert args.clients == 64 and args.pool_share == 0.5
    cfg = build_config(args)
    assert cfg.load.clients == 64 and cfg.load.time_scale is None
    live = live_working_set_tokens(cfg.trace, 64)
    blocks = int(cfg.fleet_args[cfg.fleet_args.index("--num-blocks") + 1])
    assert blocks == round(0.5 * live / 4 / 16)
    assert pressure_fleet_args(cfg.trace, 64, 4, 1.0)[3] == str(round(live / 4 / 16))
    assert any("closed-loop clients" in n for n in cfg.notes)
    with pytest.raises(SystemExit):
        parse_args(["--workload", "pool-pressure", "--pool-share", "0"])
    with pytest.raises(SystemExit):
        build_config(parse_args(["--workload", "pool-pressure", "--preset", "smoke"]))
    with pytest.raises(SystemExit):  # a misspelt router still fails the run at once
        build_config(parse_args(["--routers", "kvroute-placment"]))
