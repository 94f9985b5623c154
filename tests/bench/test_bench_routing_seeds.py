"""The multi-seed aggregation of benchmark 1: medians, pooled percentiles, paired wins.

Synthetic per-seed results and per-request records (what ``run_profile`` writes), so the
numbers can be checked by hand; the per-seed runs themselves are the routing smoke test's.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from bench.routing_seeds import (
    _cache_split_lines,
    _split_args,
    aggregate,
    cache_split,
    history_losses,
    main,
    markdown,
    merge_earlier,
    rotated,
)


def _row(name: str, p50: float, p99: float, cached: int, status: str = "ok") -> dict[str, Any]:
    return {
        "name": name,
        "label": name + " label",
        "status": status,
        "engine_prompt_tokens": 1000,
        "engine_cached_tokens": cached,
        "summary": {"ttft_p50": p50, "ttft_p99": p99},
    }


def _records(run_dir: Path, name: str, ttfts: list[float | None]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / f"{name}.records.jsonl", "w", encoding="utf-8") as f:
        for i, t in enumerate(ttfts):
            ok = t is not None
            rec = {"id": str(i), "ttft": t, "status": 200 if ok else 502, "error": None}
            f.write(json.dumps(rec) + "\n")


def test_history_losses_count_later_turns_that_found_less_than_half_the_previous_prompt() -> None:
    def rec(i: str, session: str | None, sent: float, prompt: int, cached: int) -> Any:
        return i, {"id": i, "session": session, "sent": sent, "prompt_tokens": prompt,
                   "cached_tokens": cached}  # fmt: skip

    answered = dict(
        [
            rec("a2", "a", 2.0, 3000, 999),  # < 1000 of a1's 2000: lost
            rec("a0", "a", 0.0, 1000, 0),  # first turn: not counted
            rec("a1", "a", 1.0, 2000, 500),  # exactly half of a0's 1000: kept
            rec("b0", "b", 0.5, 4000, 0),
            rec("b1", "b", 3.0, 5000, 0),  # lost
            rec("x", None, 0.1, 9000, 0),  # no session: its own conversation
        ]
    )
    assert history_losses(answered) == (3, 2)
    assert history_losses({}) == (0, 0)


def test_aggregate_medians_pooled_and_paired(tmp_path: Path) -> None:
    per_seed = {
        0: {"routers": [_row("kvroute", 0.10, 1.0, 800), _row("smg", 0.12, 0.9, 700)]},
        1: {"routers": [_row("kvroute", 0.20, 2.0, 600), _row("smg", 0.15, 2.5, 650)]},
        2: {"routers": [_row("kvroute", 0.30, 3.0, 700), _row("smg", 0.35, 3.5, 0, "failed")]},
    }
    dirs = {s: tmp_path / f"s{s}" for s in per_seed}
    _records(dirs[0], "kvroute", [1.0, 2.0, None])  # the failed request is not pooled
    _records(dirs[1], "kvroute", [3.0])
    _records(dirs[2], "kvroute", [4.0, 5.0])
    _records(dirs[0], "smg", [9.0])
    agg = aggregate(per_seed, dirs)

    kv, smg = agg["routers"]
    assert agg["reference"] == "kvroute"
    assert kv["seeds"] == [0, 1, 2] and smg["seeds"] == [0, 1]  # seed 2 failed for smg
    assert kv["cached_ratio"] == {"median": 0.7, "min": 0.6, "max": 0.8}
    assert kv["ttft_p50"] == {"median": 0.2, "min": 0.1, "max": 0.3}
    assert smg["ttft_p99"]["median"] == pytest.approx(1.7)
    assert kv["pooled"]["requests"] == 5
    assert kv["pooled"]["ttft_p50"] == 3.0
    assert kv["pooled"]["ttft_p99"] == pytest.approx(4.96)
    (pair,) = agg["paired"]
    assert pair["other"] == "smg" and pair["seeds"] == [0, 1]
    # p50: kvroute lower in seed 0 (-0.02), higher in seed 1 (+0.05)
    assert pair["ttft_p50"]["reference_lower"] == 1
    assert pair["ttft_p50"]["median_diff_s"] == pytest.approx(0.015)
    # p99: higher in seed 0 (+0.1), lower in seed 1 (-0.5)
    assert pair["ttft_p99"]["reference_lower"] == 1
    assert pair["ttft_p99"]["median_diff_s"] == pytest.approx(-0.2)

    first = {
        "fleet": {"workers": 4, "cache_backend": "sim"},
        "trace": {"name": "preset default, seed 0", "requests": 3},
        "replay": "open loop at 1.0x trace time",
    }
    md = markdown("dense", agg, first, "cmd")
    assert "| kvroute label | 3 | 70.0% (60.0%-80.0%) |" in md
    assert "| smg | 2 | 1/2, median +15.0 ms | 1/2, median -200.0 ms |" in md
    # another reference: the same seeds' differences, the other way round
    other = aggregate(per_seed, dirs, reference="smg")
    (back,) = other["paired"]
    assert other["reference"] == "smg" and back["other"] == "kvroute"
    assert back["ttft_p50"]["median_diff_s"] == pytest.approx(-0.015)
    assert aggregate(per_seed, dirs, reference="nobody")["reference"] == "kvroute"


def test_seed_arguments() -> None:
    seeds, rest, keep, report_only, ref = _split_args(["--seeds", "3,5", "--profile", "swa"])
    assert seeds == [3, 5] and rest == ["--profile", "swa"] and not keep and not report_only
    assert ref is None and _split_args(["--reference", "smg"])[4] == "smg"
    with pytest.raises(SystemExit, match="not one of --routers"):
        main(["--seeds", "0", "--smoke", "--profile", "dense", "--routers", "kvroute",
              "--reference", "smg-cache-aware", "--report-only"])  # fmt: skip
    assert _split_args(["--keep-other-routers"])[2]
    assert _split_args(["--report-only"])[3]
    with pytest.raises(SystemExit):
        _split_args(["--seeds", "1", "--seed", "2"])
    with pytest.raises(SystemExit):
        _split_args(["--seeds", ","])


def test_rows_of_routers_not_rerun_are_kept_and_marked() -> None:
    earlier = {
        "created": "day 1",
        "routers": [_row("kvroute", 0.2, 2.0, 500), _row("smg", 0.1, 1.0, 600)],
    }
    new = {"created": "day 2", "routers": [_row("kvroute", 0.15, 1.5, 700)]}
    merged = merge_earlier(new, earlier)
    assert [r["name"] for r in merged["routers"]] == ["kvroute", "smg"]
    kv, smg = merged["routers"]
    assert kv["summary"]["ttft_p50"] == 0.15 and "earlier_run" not in kv
    assert smg["earlier_run"] == "day 1" and smg["summary"]["ttft_p50"] == 0.1
    assert merge_earlier(new, None) is new


def _session_records(run_dir: Path, name: str, by_session: dict[str, list[float]]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / f"{name}.records.jsonl", "w", encoding="utf-8") as f:
        for session, ttfts in by_session.items():
            for i, t in enumerate(ttfts):
                rec = {"id": f"{session}-{i}", "session": session, "ttft": t, "status": 200}
                f.write(json.dumps(rec | {"error": None}) + "\n")


def test_pooled_differences_are_paired_by_session_and_oracle_share_is_summed(
    tmp_path: Path,
) -> None:
    per_seed = {
        0: {
            "routers": [
                _row("kvroute", 0.1, 1, 800),
                _row("smg", 0.1, 1, 700),
                _row("oracle", 0.1, 1, 1000),
            ]
        },
        1: {
            "routers": [
                _row("kvroute", 0.1, 1, 500),
                _row("smg", 0.1, 1, 600),
                _row("oracle", 0.1, 1, 600, "failed"),
            ]
        },
    }
    dirs = {s: tmp_path / f"s{s}" for s in per_seed}
    # Sessions of very different lengths; kvroute is 10 ms faster on every turn of every one.
    for s in per_seed:
        base = {f"chat-{k}": [0.05 + 0.1 * k + 0.01 * i for i in range(3)] for k in range(30)}
        _session_records(dirs[s], "smg", base)
        _session_records(dirs[s], "kvroute", {k: [t - 0.01 for t in v] for k, v in base.items()})
        _session_records(dirs[s], "oracle", base)
    agg = aggregate(per_seed, dirs)
    kv = agg["routers"][0]
    assert kv["vs_oracle"] == pytest.approx(0.8)  # seed 1's oracle failed: seed 0 only
    assert agg["routers"][2]["vs_oracle"] == pytest.approx(1.0)
    smg_pair = next(p for p in agg["paired"] if p["other"] == "smg")
    p50 = smg_pair["pooled_diff"]["ttft_p50"]
    assert p50["diff"] == pytest.approx(-0.01) and p50["verdict"] == "lower"
    assert p50["low"] == pytest.approx(-0.01) and p50["high"] == pytest.approx(-0.01)
    first = {
        "fleet": {"workers": 4, "cache_backend": "sim"},
        "trace": {"name": "preset default, seed 0", "requests": 90},
        "replay": "open loop at 1.0x trace time",
    }
    # no cached tokens in these records: every request counts as served with equal cache
    assert smg_pair["by_cache"]["same_cache"]["requests"] == 180
    assert smg_pair["by_cache"]["same_cache"]["median_diff_s"] == pytest.approx(-0.01)
    md = markdown("swa", agg, first, "cmd")
    assert "cached vs oracle" in md and "| 80.0% |" in md
    assert "| smg | 180: -10.00 ms | 0 (0 with more cached under kvroute): - |" in md
    assert "-10.0 ms [-10.0, -10.0]: lower" in md


def _rec(ttft: float, cached: int) -> dict[str, Any]:
    return {"ttft": ttft, "cached_tokens": cached}


def test_cache_split_separates_router_cost_from_routing_choices() -> None:
    seed0 = (
        {"a": _rec(0.101, 100), "b": _rec(0.203, 50), "c": _rec(0.5, 300), "x": _rec(1.0, 0)},
        {"a": _rec(0.100, 100), "b": _rec(0.200, 50), "c": _rec(0.9, 0)},
    )
    seed1 = ({"a": _rec(0.300, 0), "d": _rec(0.2, 0)}, {"a": _rec(0.1, 64), "d": _rec(0.1995, 0)})
    split = cache_split([seed0, seed1])
    same, diff = split["same_cache"], split["different_cache"]
    assert same["requests"] == 3  # seed 0's a and b, seed 1's d ("x" only one side)
    assert same["median_diff_s"] == pytest.approx(0.001)  # diffs 0.001, 0.003, 0.0005
    assert diff["requests"] == 2 and diff["reference_more_cached"] == 1
    assert diff["median_diff_s"] == pytest.approx((-0.4 + 0.2) / 2)
    assert same["parts_median_diff_s"] == {}  # no engine reported its timing
    empty = cache_split([({}, {})])
    assert empty["same_cache"] == {"requests": 0, "median_diff_s": None, "parts_median_diff_s": {}}


def _timed(ttft: float, forward: float, queue: float) -> dict[str, float | int]:
    parts = {"forward_s": forward, "parse_s": 0.002, "queue_s": queue, "prefill_s": 0.05}
    return {**_rec(ttft, 10), **parts, "return_s": ttft - sum(parts.values())}


def test_cache_split_splits_equal_cache_differences_into_parts() -> None:
    """Where the engines reported their timing, each part's paired difference is kept: a router
    that forwards 4 ms slower shows it in the forward hop, not in the queue."""
    ref = {"a": _timed(0.100, 0.006, 0.010), "b": _timed(0.200, 0.008, 0.030), "c": _rec(0.1, 10)}
    other = {"a": _timed(0.096, 0.002, 0.010), "b": _timed(0.196, 0.004, 0.030), "c": _rec(0.1, 10)}
    parts = cache_split([(ref, other)])["same_cache"]["parts_median_diff_s"]
    assert parts["forward_s"] == pytest.approx(0.004)
    assert parts["queue_s"] == pytest.approx(0.0) and parts["parse_s"] == pytest.approx(0.0)
    assert parts["return_s"] == pytest.approx(0.0)
    lines = "\n".join(
        _cache_split_lines([{"other": "smg", "by_cache": cache_split([(ref, other)])}], "kvroute")
    )
    assert "| smg | +4.00 ms | +0.00 ms | +0.00 ms | +0.00 ms | +0.00 ms |" in lines


def test_report_only_aggregates_the_saved_seeds_again(tmp_path: Path) -> None:
    for seed, (kv_p50, smg_p50) in {0: (0.1, 0.2), 1: (0.3, 0.4)}.items():
        seed_dir = tmp_path / "seeds" / f"seed{seed}"
        result = {
            "command": f"python -m bench.routing_seeds --seeds 0,1 (seed {seed})",
            "fleet": {"workers": 4, "cache_backend": "sim"},
            "trace": {"name": f"preset default, seed {seed}", "requests": 2},
            "replay": "open loop at 1.0x trace time",
            "routers": [_row("kvroute", kv_p50, 1.0, 800), _row("smg", smg_p50, 1.0, 700)],
        }
        seed_dir.mkdir(parents=True)
        (seed_dir / "routing_dense.json").write_text(json.dumps(result))
        run_dir = seed_dir / "runs" / "routing_dense"
        _session_records(run_dir, "kvroute", {"s": [kv_p50, kv_p50]})
        _session_records(run_dir, "smg", {"s": [smg_p50, smg_p50]})
    argv = ["--seeds", "0,1", "--profile", "dense", "--report-only", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    agg = json.loads((tmp_path / "routing_seeds_dense.json").read_text())
    assert agg["command"] == "python -m bench.routing_seeds --seeds 0,1"
    kv, smg = agg["routers"]
    assert smg["pooled"]["ttft_p50"] == pytest.approx(0.3)
    assert kv["pooled"]["requests"] == 4 and kv["ttft_p50"]["median"] == pytest.approx(0.2)
    (pair,) = agg["paired"]
    assert pair["ttft_p50"]["reference_lower"] == 2
    assert (tmp_path / "routing_seeds_dense.md").read_text().startswith("# Routing benchmark")
    # the records as kept under bench/results (gzipped) give the same report
    for path in tmp_path.glob("seeds/*/runs/routing_dense/*.records.jsonl"):
        with gzip.open(path.with_name(path.name + ".gz"), "wt") as out:
            out.write(path.read_text())
        path.unlink()
    assert main(argv) == 0
    again = json.loads((tmp_path / "routing_seeds_dense.json").read_text())
    assert again["routers"] == agg["routers"] and again["paired"] == agg["paired"]
    with pytest.raises(SystemExit, match="no "):
        main(["--seeds", "7", "--profile", "dense", "--report-only", "--out-dir", str(tmp_path)])


def test_routers_run_in_a_rotated_order_from_seed_to_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert rotated([], 3) == []
    orders: list[list[str]] = []

    def fake_run_profile(cfg: Any, profile: str, command: str) -> dict[str, Any]:
        orders.append(list(cfg.routers))
        run_dir = cfg.out_dir / "runs" / f"routing_{profile}"
        for name in cfg.routers:
            _session_records(run_dir, name, {"s": [0.1, 0.1]})
        return {
            "command": command,
            "fleet": {"workers": 4, "cache_backend": "sim"},
            "trace": {"name": "preset default", "requests": 2},
            "replay": "open loop at 1.0x trace time",
            "routers": [_row(name, 0.1, 1.0, 800) for name in cfg.routers],
        }

    monkeypatch.setattr("bench.routing_seeds.run_profile", fake_run_profile)
    argv = ["--seeds", "5,6,7", "--profile", "dense", "--routers", "kvroute,smg-cache-aware"]
    assert main([*argv, "--out-dir", str(tmp_path)]) == 0
    kv, smg = "kvroute", "smg-cache-aware"
    assert orders == [[kv, smg], [smg, kv], [kv, smg]]
    agg = json.loads((tmp_path / "routing_seeds_dense.json").read_text())
    assert [r["name"] for r in agg["routers"]] == [kv, smg] and agg["reference"] == kv
