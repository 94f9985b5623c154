"""Bench helpers that need no fleet: process groups, statistics, reports, summary."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.report import routing_markdown, routing_plot
from bench.run_all import write_summary
from kvroute.router.config import RouterConfig
from kvroute.testbed.procs import (
    ProcessGroup,
    free_port,
    group_alive,
    pin_process,
    pinned,
    split_cpus,
    wait_http,
)
from kvroute.testbed.sim_fleet import EngineCounters, delta, parse_counters
from kvroute.testbed.stats import RequestRecord, percentile, summarize

# A child that starts two grandchildren and ignores SIGTERM: the worst case for cleanup.
_STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
for _ in range(2):
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("ready", flush=True)
time.sleep(60)
"""


def test_process_group_kills_children_and_grandchildren(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path, term_timeout_s=0.5) as pg:
        child = pg.start("stubborn", [sys.executable, "-c", _STUBBORN])
        deadline = time.monotonic() + 10
        while "ready" not in child.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        pgid = child.popen.pid
        assert group_alive(pgid)
    deadline = time.monotonic() + 5
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not group_alive(pgid)
    assert pg.children == []


def test_wait_http_times_out_on_a_closed_port() -> None:
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        wait_http(f"http://127.0.0.1:{port}/health", 0.5)
    assert time.monotonic() - t0 < 3


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)


def _rec(i: int, ttft: float | None, ok: bool = True, cached: int = 0) -> RequestRecord:
    return RequestRecord(
        id=f"r{i}",
        session="s",
        kind="chat",
        scheduled=0.0,
        sent=float(i),
        ttft=ttft,
        latency=None if ttft is None else ttft + 1.0,
        prompt_tokens=100,
        cached_tokens=cached,
        output_tokens=10,
        status=200 if ok else 503,
        error=None if ok else "http 503: busy",
    )


def test_summary_counts_goodput_and_errors() -> None:
    recs = [_rec(0, 0.5, cached=50), _rec(1, 2.0, cached=0), _rec(2, None, ok=False)]
    s = summarize(recs, slo_ttft_s=1.0)
    assert (s.requests, s.ok, s.errors) == (3, 2, 1)
    assert s.prompt_tokens == 200 and s.cached_tokens == 50 and s.cached_ratio == 0.25
    assert s.duration_s == pytest.approx(4.0)  # first send 0, last end: sent 1 + latency 3
    assert s.goodput_req_per_s == pytest.approx(0.25, abs=1e-3)
    assert s.slo_attainment == pytest.approx(1 / 3, abs=1e-3)
    assert s.error_kinds == {"http 503": 1}
    empty = summarize([], 1.0)
    assert empty.requests == 0 and empty.req_per_s == 0.0 and math.isfinite(empty.duration_s)
    assert s.ttft_parts_p50 == {}  # no engine reported its timing


def test_ttft_parts_are_medians_and_reach_the_report() -> None:
    recs = []
    for i, forward in enumerate((0.001, 0.003, 0.010)):
        r = _rec(i, 0.1 + forward)
        r.forward_s, r.parse_s, r.queue_s, r.prefill_s = forward, 0.002, 0.0, 0.09
        r.return_s = r.ttft - (forward + 0.092) if r.ttft else None
        recs.append(r)
    recs.append(_rec(3, 9.0))  # no timing: left out of the parts, not counted as zero
    parts = summarize(recs, 1.0).ttft_parts_p50
    assert parts["forward_s"] == pytest.approx(0.003) and parts["prefill_s"] == pytest.approx(0.09)
    assert parts["return_s"] == pytest.approx(0.008)
    res = _result("dense")
    kv = res["routers"][1]  # type: ignore[index]
    kv["summary"] = {**kv["summary"], "ttft_parts_p50": parts}
    md = routing_markdown(res)
    assert "| kvroute | 3.00 | 2.00 | 0.00 | 90.00 | 8.00 |" in md
    assert "| oracle |" in md.split("Where the time")[0]
    assert "| oracle |" not in md.split("Where the time")[1]  # it reported no parts


_METRICS = """# HELP vllm:prefix_cache_queries Prefix cache queries (tokens).
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
# HELP vllm:prefix_cache_hits Prefix cache hits (tokens).
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 400.0
# TYPE vllm:request_success counter
vllm:request_success_total{finished_reason="stop",model_name="m"} 3.0
vllm:request_success_total{finished_reason="length",model_name="m"} 4.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 2.0
"""


def test_engine_counters_from_prometheus_text() -> None:
    c = parse_counters(_METRICS)
    assert c == EngineCounters(
        prefix_cache_queries=1000.0, prefix_cache_hits=400.0, requests_ok=7.0
    )
    d = delta([EngineCounters(100.0, 40.0, 1.0), EngineCounters()], [c, c])
    assert d["engine_prompt_tokens"] == 1900 and d["engine_cached_tokens"] == 760
    assert d["per_engine_requests"] == [6, 7]


def _result(profile: str, smoke: bool = False) -> dict[str, object]:
    summary = summarize([_rec(0, 0.5, cached=50), _rec(1, 0.7, cached=60)], 1.0).to_json()
    return {
        "benchmark": "routing",
        "profile": profile,
        "smoke": smoke,
        "slo_ttft_s": 1.0,
        "trace": {"name": "t", "requests": 2, "prompt_tokens": 200},
        "fleet": {"workers": 2, "profile": profile},
        "routers": [
            {
                "name": "oracle",
                "label": "oracle",
                "status": "ok",
                "summary": summary,
                "engine_cached_tokens": 120,
                "engine_prompt_tokens": 200,
            },
            {
                "name": "kvroute",
                "label": "kvroute",
                "status": "ok",
                "summary": summary,
                "engine_cached_tokens": 114,
                "engine_prompt_tokens": 200,
            },
            {"name": "smg", "label": "smg", "status": "unavailable", "reason": "not installed"},
        ],
    }


def test_report_and_summary(tmp_path: Path) -> None:
    res = _result("dense")
    md = routing_markdown(res)
    assert "| kvroute | 114 | 57.0% | 95.0% |" in md
    assert "unavailable: not installed" in md
    routing_plot(res, tmp_path / "routing_dense.png")
    assert (tmp_path / "routing_dense.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "routing_dense.json").write_text(json.dumps(res))
    (tmp_path / "routing_dense.md").write_text(md)
    (tmp_path / "routing_swa_smoke.md").write_text(routing_markdown(_result("swa", smoke=True)))
    (tmp_path / "index.md").write_text("# Index\n\n| a | b |\n")
    out = write_summary(tmp_path, [{"name": "routing", "status": "ok", "wall_s": 1.0}])
    text = out.read_text()
    assert "## routing_dense" in text and "### Routing benchmark: profile `dense`" in text
    assert "![routing_dense](routing_dense.png)" in text
    assert "swa" not in text  # smoke results stay out of the summary
    assert text.index("routing_dense") < text.index("## index") < text.index("Without a page")
    assert "- overhead: not measured yet" in text
    assert "- routing: ok (1.0 s)" in text
    assert os.path.exists(out)


def test_pinned_children_and_their_children_run_only_on_the_given_cpus(tmp_path: Path) -> None:
    mine = sorted(os.sched_getaffinity(0))
    cpu = mine[-1]
    # the child reports its own CPUs and those of a grandchild it starts
    show = "import os; print(sorted(os.sched_getaffinity(0)))"
    code = f"{show}; import subprocess, sys; subprocess.run([sys.executable, '-c', {show!r}])"
    with ProcessGroup(tmp_path) as pg:
        pinned = pg.start("pinned", [sys.executable, "-c", code], cpus=[cpu])
        free = pg.start("free", [sys.executable, "-c", code])
        assert pinned.popen.wait(30) == 0 and free.popen.wait(30) == 0
    assert pinned.log.read_text().split("\n")[:2] == [str([cpu])] * 2
    assert free.log.read_text().split("\n")[:2] == [str(mine)] * 2


def test_router_cpus_split_from_the_rest() -> None:
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        with pytest.raises(ValueError, match="no CPU left"):
            split_cpus(mine)
        return
    router, rest = split_cpus([mine[-1], mine[-1]])
    assert router == (mine[-1],) and rest == tuple(mine[:-1])
    with pytest.raises(ValueError, match="not available"):
        split_cpus([max(mine) + 1000])
    with pytest.raises(ValueError, match="no CPU left"):
        split_cpus(mine)
    with pytest.raises(ValueError):
        split_cpus([])


def test_pinned_moves_this_process_and_restores_it() -> None:
    mine = os.sched_getaffinity(0)
    cpu = max(mine)
    with pinned([cpu]):
        assert os.sched_getaffinity(0) == {cpu}
    assert os.sched_getaffinity(0) == mine
    with pytest.raises(RuntimeError), pinned([cpu]):
        raise RuntimeError("the run failed")
    assert os.sched_getaffinity(0) == mine  # restored on failure too
    with pinned(None):
        assert os.sched_getaffinity(0) == mine


def test_pin_process_moves_every_thread_of_a_running_process() -> None:
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("needs two CPUs to tell a pinned thread from an unpinned one")
    cpu = mine[-1]
    # a thread started before the pin reports its own mask after it, then the main thread
    code = (
        "import os, sys, threading\n"
        "go = threading.Event()\n"
        "def report():\n"
        "    go.wait(); print(sorted(os.sched_getaffinity(0)), flush=True)\n"
        "t = threading.Thread(target=report); t.start()\n"
        "print('ready', flush=True); sys.stdin.readline(); go.set(); t.join()\n"
        "print(sorted(os.sched_getaffinity(0)), flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        pin_process(proc.pid, [cpu])
        out, _ = proc.communicate("go\n", timeout=30)
    finally:
        proc.kill()
    assert out.strip().split("\n") == [str([cpu])] * 2
    pin_process(2**22 + 12345, [cpu])  # a process that is gone: nothing to do, no error


def test_bridges_run_only_for_the_router_that_reads_them() -> None:
    from bench.routing_bench import BenchConfig, _fleet_args
    from kvroute.testbed.routers import ROUTERS

    base = dict(
        profiles=["dense"], routers=["kvroute"], workers=2, smoke=True, trace_name="t",
        trace=[], load=None, slo_ttft_s=0.5, out_dir=Path("."), fleet_args=("--speed", "1"),
    )  # fmt: skip
    fleet = BenchConfig(**base, bridges="fleet")  # type: ignore[arg-type]
    router = BenchConfig(**base, bridges="router")  # type: ignore[arg-type]
    kv, smg, proxy = ROUTERS["kvroute"], ROUTERS["smg-cache-aware"], ROUTERS["oracle"]
    assert _fleet_args(fleet, smg) == ("--speed", "1")
    assert _fleet_args(fleet, kv) == ("--speed", "1")
    # beside the router kvroute's bridges run at SCHED_IDLE unless told otherwise
    assert _fleet_args(router, kv) == ("--speed", "1", "--bridge-sched-idle")
    nice = BenchConfig(**base, bridges="router", bridge_sched="nice")  # type: ignore[arg-type]
    assert _fleet_args(nice, kv) == ("--speed", "1")
    assert _fleet_args(router, smg) == ("--speed", "1", "--no-bridge")
    assert _fleet_args(router, proxy) == ("--speed", "1", "--no-bridge")
    already = BenchConfig(  # type: ignore[arg-type]
        **{**base, "fleet_args": ("--no-bridge",)}, bridges="router"
    )
    assert _fleet_args(already, smg) == ("--no-bridge",)
    # a kvroute variant's own scheduling class wins over the bench's
    nice_spec = ROUTERS["kvroute-bridges-nice"]
    assert _fleet_args(router, nice_spec) == ("--speed", "1")
    idle_spec = dataclasses.replace(kv, bridge_sched="idle")
    assert _fleet_args(fleet, idle_spec) == ("--speed", "1", "--bridge-sched-idle")


def test_bridges_beside_the_router_only_when_the_router_has_cpus_of_its_own() -> None:
    from bench.routing_bench import build_config, parse_args

    assert build_config(parse_args(["--smoke", "--profile", "dense"])).bridges == "fleet"
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) >= 2:
        argv = ["--smoke", "--profile", "dense", "--router-cpus", str(mine[-1])]
        assert build_config(parse_args(argv)).bridges == "router"
        assert build_config(parse_args([*argv, "--bridges", "fleet"])).bridges == "fleet"


def _variant_configs(tmp_path: Path, *names: str) -> dict[str, RouterConfig]:
    """The router config each named bench router runs with: the config `kvroute sim fleet`
    writes, plus the router's environment."""
    import yaml

    from kvroute.router.config_load import load_config
    from kvroute.sim.fleet_cli import router_config
    from kvroute.testbed.routers import ROUTERS

    config = router_config([], "kvroute-sim", 16, via_bridge=False)
    config["workers"] = [{"name": "a", "url": "http://127.0.0.1:1", "model": "kvroute-sim"}]
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(config))
    return {name: load_config(str(path), env=dict(ROUTERS[name].env)) for name in names}


def test_the_chat_upstream_variant_turns_token_ids_off_in_the_sim_fleets_config(
    tmp_path: Path,
) -> None:
    """The bench's kvroute runs with the config `kvroute sim fleet` writes (token ids sent to
    the engines); `kvroute-chat-upstream` overrides that through its environment alone."""
    loaded = _variant_configs(tmp_path, "kvroute", "kvroute-chat-upstream")
    sends = {name: cfg.models["kvroute-sim"] for name, cfg in loaded.items()}
    assert {k: v.send_token_ids for k, v in sends.items()} == {
        "kvroute": True,
        "kvroute-chat-upstream": False,
    }
    assert sends["kvroute-chat-upstream"].tokenizer == sends["kvroute"].tokenizer


def test_the_no_answer_cache_variant_turns_only_remember_answers_off(tmp_path: Path) -> None:
    loaded = _variant_configs(tmp_path, "kvroute", "kvroute-no-answer-cache")
    base, variant = loaded["kvroute"], loaded["kvroute-no-answer-cache"]
    assert base.tokenizer.remember_answers
    assert not variant.tokenizer.remember_answers
    assert variant.models == base.models and variant.policy == base.policy


def test_mooncake_replays_send_no_session_header() -> None:
    from bench.routing_bench import load_config, parse_args

    mooncake = load_config(parse_args(["--mooncake", "trace.jsonl"]))
    own = load_config(parse_args([]))
    assert mooncake.session_header is None  # the trace has no session ids to send
    assert own.session_header == "x-session-id"  # the generator's traces do
