"""bench.chain_diagnosis: which continuing requests left their parent's worker, and why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.chain_diagnosis import _align_decisions, diagnose, main, summarize

BLOCK = 512


def _trace(tmp_path: Path) -> Path:
    # two conversations: A (blocks 0,1,2 then 0,1,2,3) and B (0,5,6 then 0,5,6,7); block 0 is
    # shared by all, as the system prompt is in the real trace
    lines = [
        {"timestamp": 0, "input_length": 3 * BLOCK, "output_length": 8, "hash_ids": [0, 1, 2]},
        {"timestamp": 10, "input_length": 3 * BLOCK, "output_length": 8, "hash_ids": [0, 5, 6]},
        {
            "timestamp": 20,
            "input_length": 4 * BLOCK - 100,
            "output_length": 8,
            "hash_ids": [0, 1, 2, 3],
        },
        {"timestamp": 30, "input_length": 4 * BLOCK, "output_length": 8, "hash_ids": [0, 5, 6, 7]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _record(i: int, worker: str, cached: int, n: int) -> dict[str, Any]:
    return {
        "id": f"mc-{i:06d}",
        "sent": float(i),
        "status": 200,
        "worker": worker,
        "cached_tokens": cached,
        "prompt_tokens": n,
    }


def _decision(i: int, n: int, reason: str, cands: dict[str, tuple[int, float, float]]) -> dict:
    return {
        "id": i + 1,
        "prompt_tokens": n,
        "reason": reason,
        "candidates": [
            {
                "worker": w,
                "predicted_reuse": reuse,
                "cost_s": load + 1.0,
                "terms": {"queue": load, "prefill": 1.0},
            }
            for w, (reuse, load, _) in cands.items()
        ],
    }


def _run(tmp_path: Path) -> tuple[Path, list[dict[str, Any]], list[dict[str, Any]]]:
    records = [
        _record(0, "w1", 0, 3 * BLOCK),
        _record(1, "w2", 0, 3 * BLOCK),
        _record(2, "w1", 3 * BLOCK, 4 * BLOCK - 100),  # A stayed on w1 and found its history
        _record(3, "w1", BLOCK, 4 * BLOCK),  # B left w2 for w1: only block 0 was there
    ]
    decisions = [
        _decision(0, 3 * BLOCK, "cold", {"w1": (0, 0.0, 0), "w2": (0, 0.0, 0)}),
        _decision(1, 3 * BLOCK, "cold", {"w1": (BLOCK, 0.5, 0), "w2": (0, 0.0, 0)}),
        _decision(2, 4 * BLOCK - 100, "prefix", {"w1": (3 * BLOCK, 0.1, 0), "w2": (BLOCK, 0.0, 0)}),
        _decision(3, 4 * BLOCK, "load", {"w1": (BLOCK, 0.2, 0), "w2": (3 * BLOCK, 2.5, 0)}),
    ]
    return _trace(tmp_path), records, decisions


def test_rows_say_who_left_and_what_it_cost(tmp_path: Path) -> None:
    trace, records, decisions = _run(tmp_path)
    rows = {r.id: r for r in diagnose(trace, records, decisions)}
    assert set(rows) == {"mc-000002", "mc-000003"}  # the first turns have no parent

    a = rows["mc-000002"]
    assert (a.parent_id, a.followed, a.reason) == ("mc-000000", True, "prefix")
    assert a.shared_tokens == 3 * BLOCK and a.lost_tokens == 0
    assert a.predicted_on_parent == a.predicted_on_chosen == 3 * BLOCK

    b = rows["mc-000003"]
    assert (b.parent_id, b.parent_worker, b.worker) == ("mc-000001", "w2", "w1")
    assert not b.followed and b.reason == "load"
    assert b.shared_tokens == 3 * BLOCK and b.lost_tokens == 2 * BLOCK
    assert (b.predicted_on_parent, b.predicted_on_chosen) == (3 * BLOCK, BLOCK)
    assert b.cost_on_parent_s == pytest.approx(3.5) and b.cost_on_chosen_s == pytest.approx(1.2)
    # the queue term moved it: 2.5 s on the parent's worker against 0.2 s on the chosen one
    assert b.term_gap_s == {"queue": pytest.approx(2.3), "prefill": 0.0}

    table = summarize(list(rows.values()))
    assert "| left | load | index held it | 1 | 1,536 | 1,024 | queue +2.300 |" in table
    assert "1,024 of 3,072 tokens shared with the parent not found cached (33.3%)" in table


def test_without_decisions_rows_still_count_the_loss(tmp_path: Path) -> None:
    trace, records, _ = _run(tmp_path)
    rows = diagnose(trace, records, None)
    assert [r.lost_tokens for r in rows] == [0, 2 * BLOCK]
    assert all(r.reason is None and r.term_gap_s == {} for r in rows)


def test_decisions_pair_with_requests_that_overtook_each_other(tmp_path: Path) -> None:
    trace, records, decisions = _run(tmp_path)
    # B's second turn reached the router before A's: the decisions swap, the rows do not
    decisions[2], decisions[3] = decisions[3], decisions[2]
    decisions[2]["id"], decisions[3]["id"] = 3, 4
    rows = {r.id: r for r in diagnose(trace, records, decisions)}
    assert (rows["mc-000002"].reason, rows["mc-000003"].reason) == ("prefix", "load")


def test_a_decision_made_many_places_out_of_send_order_still_pairs() -> None:
    # a burst: request 40 of 60 reached the router before 35 that were sent before it
    records = [_record(i, "w0", 0, 1000 + i) for i in range(60)]
    order = [i for i in range(60) if i != 40]
    order.insert(5, 40)
    decisions = [{"id": k + 1, "prompt_tokens": 1000 + i} for k, i in enumerate(order)]
    paired = _align_decisions(records, decisions)
    assert all(paired[f"mc-{i:06d}"]["prompt_tokens"] == 1000 + i for i in range(60))


def test_failed_requests_are_left_out(tmp_path: Path) -> None:
    trace, records, decisions = _run(tmp_path)
    records[1]["status"] = 503  # B's first turn failed: its continuation has no parent worker
    assert [r.id for r in diagnose(trace, records, decisions)] == ["mc-000002"]


def test_decisions_that_do_not_match_the_requests_are_refused(tmp_path: Path) -> None:
    trace, records, decisions = _run(tmp_path)
    decisions[2]["prompt_tokens"] = 7
    with pytest.raises(ValueError, match="does not match any request"):
        diagnose(trace, records, decisions)


def test_cli_writes_rows_next_to_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, records, decisions = _run(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "kvroute.records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "kvroute.decisions.jsonl").write_text("".join(json.dumps(d) + "\n" for d in decisions))
    assert main(["--trace", str(trace), "--run-dir", str(run)]) == 0
    written = json.loads((run / "kvroute.chains.json").read_text())
    assert [r["id"] for r in written] == ["mc-000002", "mc-000003"]
    assert "| left | load |" in capsys.readouterr().out


def test_ttft_compared_by_chain(tmp_path: Path) -> None:
    from bench.chain_diagnosis import compare_by_chain

    trace, records, _ = _run(tmp_path)
    fast = [dict(r, ttft=0.1 + i / 100) for i, r in enumerate(records)]
    slow = [dict(r, ttft=1.0 + i / 100) for i, r in enumerate(records)]
    d = compare_by_chain(trace, fast, slow)
    p50 = d["ttft_p50"]
    assert p50 is not None and p50.diff == pytest.approx(-0.9)
    assert p50.high < 0 and p50.verdict == "lower"
    same = compare_by_chain(trace, fast, fast)["ttft_p99"]
    assert same is not None and same.diff == 0.0 and same.verdict == "not distinguishable"


def test_ttft_compared_on_a_subset_counts_only_those_requests(tmp_path: Path) -> None:
    from bench.chain_diagnosis import compare_by_chain

    trace, records, _ = _run(tmp_path)
    ids = [r["id"] for r in records]
    # the two replays differ only on the last request
    first = [dict(r, ttft=0.5) for r in records]
    second = [dict(r, ttft=0.5 if r["id"] != ids[-1] else 2.0) for r in records]
    only_last = compare_by_chain(trace, first, second, ids={ids[-1]})["ttft_p50"]
    assert only_last is not None and only_last.diff == pytest.approx(-1.5)
    rest = compare_by_chain(trace, first, second, ids=set(ids[:-1]))["ttft_p50"]
    assert rest is not None and rest.diff == 0.0
    assert compare_by_chain(trace, first, second, ids=set())["ttft_p50"] is None
