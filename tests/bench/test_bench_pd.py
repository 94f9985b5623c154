"""The prefill/decode profile of the routing benchmark: its fleet and router choices, the
round-robin P/D proxy (against simulated producer and consumer engines on loopback), the
per-pool counters, the time per output token and the tables."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from aiohttp import web

from bench.pd_diagnosis import main as pd_main
from bench.pd_diagnosis import report, run_dirs
from bench.proxy import PREFILL_PARAMS, make_app, prefill_body
from bench.report import pd_rows, routing_markdown
from bench.routing_bench import PD_ROUTERS, build_config, parse_args, parse_pd
from bench.routing_seeds import aggregate, markdown
from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.engine.kv_transfer import TransferConfig
from kvroute.sim.server import SimEngineThread
from kvroute.testbed import routers
from kvroute.testbed.peers import Peers
from kvroute.testbed.routers import ROUTERS, RouterUnavailable, command
from kvroute.testbed.sim_fleet import Engine, EngineCounters, delta, pd_pools, scrape
from kvroute.testbed.stats import RequestRecord, summarize, tpot

PROMPT = "A prefill engine computes the prompt; a decode engine pulls it and writes. " * 12


# ---- fleet and router choices ------------------------------------------------------------
def test_pd_option_makes_a_pd_fleet_with_the_pd_routers() -> None:
    cfg = build_config(parse_args(["--pd", "2,3", "--smoke", "--profile", "dense"]))
    assert cfg.pd == (2, 3) and cfg.routers == PD_ROUTERS
    assert cfg.suffix == "_pd_smoke" and any("2 prefill engines" in n for n in cfg.notes)
    plain = build_config(parse_args(["--smoke", "--profile", "dense"]))
    assert plain.pd is None and plain.suffix == "_smoke"


def test_pd_routers_and_mixed_fleets_are_not_mixed_up() -> None:
    with pytest.raises(SystemExit, match="do not split prefill and decode"):
        build_config(parse_args(["--pd", "1,1", "--routers", "kvroute,smg-cache-aware"]))
    with pytest.raises(SystemExit, match="need a prefill/decode fleet"):
        build_config(parse_args(["--routers", "kvroute,smg-pd"]))
    # kvroute splits on its own, from the roles the P/D fleet's config gives the workers
    assert build_config(parse_args(["--pd", "1,1", "--routers", "kvroute"])).routers == ("kvroute",)


@pytest.mark.parametrize("bad", ["2", "1,0", "a,b", "1,2,3"])
def test_pd_counts_must_be_two_positive_numbers(bad: str) -> None:
    with pytest.raises(SystemExit, match="--pd"):
        parse_pd(bad)
    assert parse_pd(None) is None and parse_pd("2,1") == (2, 1)


PD_FLEET: Any = SimpleNamespace(
    engines=[
        Engine("prefill-0", "http://127.0.0.1:1", "prefill"),
        Engine("prefill-1", "http://127.0.0.1:2", "prefill"),
        Engine("decode-0", "http://127.0.0.1:3", "decode"),
    ],
    config_path=Path("fleet.yaml"),
)
PEERS = Peers(Path("peers/smg"), Path("peers/vllm-router"))


def test_peer_pd_modes_get_the_pools_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routers, "free_port", lambda: 4242)
    vr = command(ROUTERS["vllm-router-pd"], 9000, PD_FLEET, PEERS)
    smg = command(ROUTERS["smg-pd"], 9000, PD_FLEET, PEERS)
    pools = [
        "--prefill", "http://127.0.0.1:1", "--prefill", "http://127.0.0.1:2",
        "--decode", "http://127.0.0.1:3",
    ]  # fmt: skip
    for argv, flag in ((vr, "--vllm-pd-disaggregation"), (smg, "--pd-disaggregation")):
        at = argv.index(flag)
        assert argv[at + 1 : at + 1 + len(pools)] == pools
        assert "--worker-urls" not in argv and argv[argv.index("--policy") + 1] == "cache_aware"
    proxy = command(ROUTERS["pd-round-robin"], 9000, PD_FLEET, PEERS)
    assert proxy[proxy.index("--prefill") + 1] == "http://127.0.0.1:1,http://127.0.0.1:2"
    assert proxy[proxy.index("--decode") + 1] == "http://127.0.0.1:3"
    assert "--engines" not in proxy
    mixed: Any = SimpleNamespace(engines=[Engine("sim-0", "http://127.0.0.1:1")])
    with pytest.raises(RouterUnavailable, match="prefill and decode engines"):
        command(ROUTERS["smg-pd"], 9000, mixed, PEERS)


# ---- counters, TPOT and tables -------------------------------------------------------------
def test_pd_pools_split_the_counters_by_role() -> None:
    engines = [
        Engine("prefill-0", "u0", "prefill"),
        Engine("decode-0", "u1", "decode"),
        Engine("decode-1", "u2", "decode"),
    ]
    before = [EngineCounters(), EngineCounters(), EngineCounters(kv_pulls=5, kv_blocks_pulled=50)]
    after = [
        EngineCounters(100, 40, 4, busy_seconds=2.0, kv_leases=4, kv_leases_expired=1),
        EngineCounters(60, 30, 2, busy_seconds=1.0, kv_pulls=2, kv_blocks_pulled=5),
        EngineCounters(
            40, 0, 2, busy_seconds=0.5, kv_pulls=7, kv_blocks_pulled=51, kv_pull_failures=1
        ),
    ]
    row = delta(before, after)
    assert row["per_engine_kv_blocks_pulled"] == [0, 5, 1]
    pools = pd_pools(engines, row, answered=4)
    assert pools["prefill"] == {
        "engines": 1, "requests": 4, "prompt_tokens": 100, "cached_tokens": 40,
        "cached_ratio": 0.4, "busy_s": 2.0,
    }  # fmt: skip
    assert pools["decode"]["prompt_tokens"] == 100 and pools["decode"]["cached_ratio"] == 0.3
    assert pools["decode"]["busy_s"] == 1.5 and pools["kv_leases"] == 4
    assert pools["kv_leases_expired"] == 1 and pools["kv_pull_failures"] == 1
    assert pools["kv_pulls"] == 4 and pools["kv_blocks_pulled"] == 6
    assert pools["kv_pulls_per_request"] == 1.0 and pools["kv_blocks_per_request"] == 1.5
    assert pd_pools(engines, row, answered=0)["kv_blocks_per_request"] is None


def test_tpot_is_the_time_per_token_after_the_first() -> None:
    def rec(ttft: float, latency: float, tokens: int) -> RequestRecord:
        return RequestRecord("r", "s", "chat", 0.0, sent=0.0, ttft=ttft, latency=latency,
                             output_tokens=tokens, status=200)  # fmt: skip

    assert tpot(rec(0.1, 1.1, 11)) == pytest.approx(0.1)
    assert tpot(rec(0.1, 0.1, 1)) is None  # one token: no time between tokens
    records = [rec(0.1, 0.1 + 0.01 * (n - 1), n) for n in (2, 5, 9)] + [rec(0.2, 0.2, 1)]
    records.append(rec(0.1, 2.1, 3))  # 1 s per token
    s = summarize(records, slo_ttft_s=1.0)
    assert s.tpot_p50 == pytest.approx(0.01) and s.tpot_p99 == pytest.approx(0.97, abs=0.01)


def _pd_row(name: str, tpot_p50: float, blocks: float, cached: tuple[float, float]) -> Any:
    return {
        "name": name,
        "label": name + " label",
        "status": "ok",
        "engine_prompt_tokens": 1000,
        "engine_cached_tokens": 500,
        "summary": {
            "ttft_p50": 0.1, "ttft_p90": 0.2, "ttft_p99": 0.3, "req_per_s": 1.0,
            "output_tok_per_s": 10.0, "goodput_req_per_s": 1.0, "errors": 0,
            "cached_tokens": 0, "prompt_tokens": 0, "tpot_p50": tpot_p50, "tpot_p99": 0.02,
        },
        "pd": {
            "prefill": {"cached_ratio": cached[0], "busy_s": 3.0},
            "decode": {"cached_ratio": cached[1], "busy_s": 1.5},
            "kv_pulls_per_request": 1.0, "kv_blocks_per_request": blocks,
            "kv_pull_failures": 2,
        },
    }  # fmt: skip


def test_the_pd_table_shows_each_pool_and_the_pulls() -> None:
    result = {
        "profile": "dense",
        "routers": [_pd_row("kvroute", 0.0061, 12.5, (0.6, 0.25))],
        "fleet": {"workers": 4, "pd": [2, 2]},
    }
    headers, rows = pd_rows(result)
    assert rows == [
        ["kvroute label", "0.100", "0.300", "6.10", "20.00", "60.0%", "25.0%", "1.00", "12.5",
         "2", "3.0 / 1.5", "0"]
    ]  # fmt: skip
    assert "blocks pulled per request" in headers
    md = routing_markdown(result)
    assert "| kvroute label | 0.100 | 0.300 | 6.10 |" in md
    assert "Fleet: 2 prefill + 2 decode simulated engines (" in md
    assert "holds the whole prefill phase" not in md  # no TTFT parts reported
    parts = {k: 0.001 for k in ("forward_s", "parse_s", "queue_s", "prefill_s", "return_s")}
    result["routers"][0]["summary"]["ttft_parts_p50"] = parts
    assert "holds the whole prefill phase" in routing_markdown(result)
    result["fleet"]["pd"] = None
    assert "holds the whole prefill phase" not in routing_markdown(result)
    assert pd_rows({"routers": [{**_pd_row("x", 0.1, 1, (0, 0)), "pd": None}]})[1] == []


def _records(
    run_dir: Path,
    name: str,
    rows: list[tuple[str, float, float, int]],
    pulled: list[int | None] | None = None,
) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / f"{name}.records.jsonl", "w", encoding="utf-8") as f:
        for i, (session, ttft, latency, tokens) in enumerate(rows):
            rec = {"id": str(i), "session": session, "ttft": ttft, "latency": latency,
                   "output_tokens": tokens, "status": 200, "error": None,
                   "pulled_blocks": None if pulled is None else pulled[i]}  # fmt: skip
            f.write(json.dumps(rec) + "\n")


def test_seeds_aggregate_tpot_and_pools_with_intervals(tmp_path: Path) -> None:
    per_seed = {
        0: {"routers": [_pd_row("kvroute", 0.006, 10.0, (0.5, 0.2)),
                        _pd_row("smg-pd", 0.008, 0.0, (0.5, 0.4))]},
        1: {"routers": [_pd_row("kvroute", 0.007, 14.0, (0.7, 0.3)),
                        _pd_row("smg-pd", 0.009, 0.0, (0.6, 0.5))]},
    }  # fmt: skip
    dirs = {s: tmp_path / f"s{s}" for s in per_seed}
    for s in per_seed:  # kvroute 10 ms per token after the first, smg 20 ms, in 4 sessions
        # blocks each request pulled: kvroute 2 fewer in each session (one request unreported)
        kv_pulled: list[int | None] = [10 * i + s for i in range(4)]
        kv_pulled[3] = None
        _records(
            dirs[s], "kvroute", [(f"c{i}", 0.1, 0.1 + 0.01 * 4, 5) for i in range(4)], kv_pulled
        )
        smg_pulled: list[int | None] = [10 * i + s + 2 for i in range(4)]
        smg_pulled[3] = None
        _records(
            dirs[s], "smg-pd", [(f"c{i}", 0.1, 0.1 + 0.02 * 4, 5) for i in range(4)], smg_pulled
        )
    agg = aggregate(per_seed, dirs)
    kv, smg = agg["routers"]
    assert kv["pd"]["tpot_p50"] == pytest.approx({"median": 0.0065, "min": 0.006, "max": 0.007})
    assert kv["pd"]["blocks_per_request"] == {"median": 12.0, "min": 10.0, "max": 14.0}
    assert smg["pd"]["decode_cached_ratio"]["median"] == pytest.approx(0.45)
    assert kv["pd"]["pooled"]["requests"] == 8
    assert kv["pd"]["pooled"]["tpot_p50"] == pytest.approx(0.01)
    # blocks per request: the mean of the 6 reported (0, 10, 20 and 1, 11, 21)
    assert kv["pd"]["pooled"]["blocks_requests"] == 6
    assert kv["pd"]["pooled"]["blocks_per_request"] == pytest.approx(63 / 6)
    (pair,) = agg["paired"]
    d = pair["pooled_diff"]["tpot_p50"]
    assert d["diff"] == pytest.approx(-0.01) and d["verdict"] == "lower"
    b = pair["pooled_diff"]["blocks_per_request"]
    assert b["diff"] == pytest.approx(-2.0) and b["verdict"] == "lower"
    assert b["low"] == pytest.approx(-2.0) and b["high"] == pytest.approx(-2.0)
    first = {"fleet": {"workers": 4, "cache_backend": "sim"}, "replay": "open loop",
             "trace": {"name": "preset default, seed 0", "requests": 4}}  # fmt: skip
    md = markdown("dense", agg, first, "cmd")
    assert "Fleet: 4 simulated engines" in md
    assert "| kvroute label | 6.50 (6.00-7.00) |" in md
    first["fleet"]["pd"] = [1, 3]
    assert "Fleet: 1 prefill + 3 decode simulated engines" in markdown("dense", agg, first, "")
    assert "| smg-pd | -10.00 ms [-10.00, -10.00]: lower |" in md
    assert "| -2.0 [-2.0, -2.0]: lower |" in md
    assert "| 10.5 |" in md  # kvroute's pooled blocks per request
    # a run of mixed engines has no P/D table
    plain = {
        s: {"routers": [{k: x for k, x in r.items() if k != "pd"} for r in v["routers"]]}
        for s, v in per_seed.items()
    }
    assert "pd" not in aggregate(plain, dirs)["routers"][0]


# ---- the round-robin P/D proxy against simulated engines ----------------------------------
def _engine(role: str, name: str | None = None) -> SimEngineThread:
    cfg = EngineConfig(
        speed=50.0, num_blocks=512, max_model_len=2048, kv_transfer=TransferConfig(role)
    )
    return SimEngineThread(cfg, name=name)  # a named engine reports its timing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Proxy:
    """bench.proxy's app served from a thread of its own."""

    def __init__(self, app: web.Application) -> None:
        import threading

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(app)
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> _Proxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    async def _start(self) -> None:
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


@pytest.fixture(scope="module")
def pd_proxy() -> Iterator[tuple[str, SimEngineThread, list[SimEngineThread]]]:
    with (
        _engine("kv_producer") as producer,
        _engine("kv_consumer", "decode-0") as d0,
        _engine("kv_consumer", "decode-1") as d1,
        _Proxy(make_app([d0.url, d1.url], "round_robin", prefill=[producer.url])) as proxy,
    ):
        yield proxy.url, producer, [d0, d1]


def _kv_state(engine: SimEngineThread) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(engine.url + "/sim/state", timeout=5).json()["kv_transfer"]
    return out


def test_prefill_body_asks_for_one_token_and_kept_blocks() -> None:
    body = {"model": "m", "prompt": "p", "max_tokens": 50, "max_completion_tokens": 50,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    out = prefill_body(body)
    assert out == {"model": "m", "prompt": "p", "max_tokens": 1, "stream": False,
                   "kv_transfer_params": PREFILL_PARAMS}  # fmt: skip
    assert body["max_tokens"] == 50  # the client's request is left as it was


def test_pd_proxy_takes_both_pools_in_turn_and_decode_pulls(
    pd_proxy: tuple[str, SimEngineThread, list[SimEngineThread]],
) -> None:
    url, producer, decodes = pd_proxy
    workers = []
    pulled = {"decode-0": 0, "decode-1": 0}  # blocks, from each answer's engine timing
    for i in range(4):
        body = {"model": "kvroute-sim", "prompt": f"{i} {PROMPT}", "max_tokens": 5,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            workers.append(r.headers["x-bench-worker"])
            chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert chunks[-1]["usage"]["completion_tokens"] == 5
        blocks = chunks[-1]["kvroute_engine_timing"]["pulled_blocks"]
        pulled[chunks[-1]["system_fingerprint"]] += blocks
        assert blocks >= len(PROMPT) // 4 // 16
    assert workers == ["prefill-0/decode-0", "prefill-0/decode-1"] * 2
    states = [_kv_state(d) for d in decodes]
    assert [pulled["decode-0"], pulled["decode-1"]] == [s["blocks_pulled"] for s in states]
    assert [s["pulls"] for s in states] == [{"ok": 2}, {"ok": 2}]
    assert all(s["blocks_pulled"] >= 2 * (len(PROMPT) // 4 // 16) for s in states)
    produced = _kv_state(producer)
    assert produced["leases_granted"] == 4 and produced["leases_pulled"] == 4
    # what the bench reads of these engines
    engines = [Engine("prefill-0", producer.url, "prefill")]
    engines += [Engine(f"decode-{i}", d.url, "decode") for i, d in enumerate(decodes)]
    counters = scrape(engines)
    assert [c.kv_pulls for c in counters] == [0, 2, 2] and counters[0].kv_leases == 4
    assert [c.kv_blocks_pulled for c in counters[1:]] == [s["blocks_pulled"] for s in states]
    assert all(c.kv_pull_failures == 0 for c in counters)


def test_a_pull_that_brought_nothing_is_counted() -> None:
    with _engine("kv_consumer") as consumer:
        body = {"model": "kvroute-sim", "prompt": PROMPT, "max_tokens": 2,
                "kv_transfer_params": {"do_remote_prefill": True}}  # fmt: skip
        assert httpx.post(consumer.url + "/v1/completions", json=body, timeout=30).is_success
        (counters,) = scrape([Engine("decode-0", consumer.url, "decode")])
    assert counters.kv_pulls == 1 and counters.kv_pull_failures == 1
    assert counters.kv_blocks_pulled == 0


def test_pd_proxy_chat_and_non_streamed(
    pd_proxy: tuple[str, SimEngineThread, list[SimEngineThread]],
) -> None:
    url, _, _ = pd_proxy
    body = {"model": "kvroute-sim", "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 4}  # fmt: skip
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert answer["usage"]["completion_tokens"] == 4 and answer["choices"][0]["message"]
    assert httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"] == "kvroute-sim"


def test_pd_proxy_passes_a_prefill_error_through(
    pd_proxy: tuple[str, SimEngineThread, list[SimEngineThread]],
) -> None:
    url, _, decodes = pd_proxy
    before = [_kv_state(d)["pulls"] for d in decodes]
    resp = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=10)
    assert resp.status_code == 404 and resp.headers["x-bench-worker"] == "prefill-0"
    assert [_kv_state(d)["pulls"] for d in decodes] == before  # no decode was asked


def test_pd_proxy_takes_only_round_robin() -> None:
    with pytest.raises(ValueError, match="round robin"):
        make_app(["http://d"], "prefix", prefill=["http://p"])


# ---- the diagnosis of a P/D run -----------------------------------------------------------
def _write(path: Path, rows: list[dict[str, Any]], packed: bool = False) -> None:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    if packed:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)


def _decision(prefill: str, decode: str, reuse: dict[str, int], reason: str = "cache") -> Any:
    return {
        "reason": reason,
        "pd": {
            "prefill": [{"worker": prefill, "outcome": "200", "seconds": 0.1}],
            "decode": [{"worker": decode, "outcome": "200", "seconds": 0.02}],
            "decode_candidates": [{"worker": w, "predicted_reuse": n} for w, n in reuse.items()],
        },
    }


def test_pd_diagnosis_reads_every_seeds_runs(tmp_path: Path) -> None:
    def rec(worker: str, forward: float) -> dict[str, Any]:
        return {"ttft": forward + 0.05, "worker": worker, "forward_s": forward, "parse_s": 0.01,
                "queue_s": 0.01, "prefill_s": 0.02, "return_s": 0.01}  # fmt: skip

    for seed, packed in ((0, False), (1, True)):  # kept results are gzipped
        run = tmp_path / "seeds" / f"seed{seed}" / "runs" / "routing_dense_pd"
        _write(run / "kvroute.records.jsonl", [rec("decode-0", 0.1), rec("decode-1", 0.3)], packed)
        _write(run / "smg-pd.records.jsonl", [rec("decode-0", 1.0)], packed)
        _write(run / "kvroute.decisions.jsonl", [
            _decision("prefill-0", "decode-0", {"decode-0": 32, "decode-1": 0}),
            _decision("prefill-1", "decode-1", {"decode-0": 32, "decode-1": 0}, "session"),
            _decision("prefill-1", "decode-0", {"decode-0": 0, "decode-1": 0}),
        ])  # fmt: skip
    dirs = run_dirs(tmp_path)
    assert [d.parent.parent.name for d in dirs] == ["seed0", "seed1"]
    md = report(dirs)
    assert "| kvroute | 4 | 250 | 200 (300) |" in md  # forwards 0.1, 0.3, 0.1, 0.3
    assert "| smg-pd | 2 | 1050 | 1000 (1000) |" in md
    assert "| kvroute | decode-0 2, decode-1 2 |" in md
    assert "prefill choices by reason: cache 4, session 2" in md
    assert "prefill workers: prefill-0 2, prefill-1 4; decode workers: decode-0 4, decode-1 2" in md
    # the third decision's candidates were equal: not counted
    assert "predicted reuse differed: 4; the chosen one had the most in 2" in md
    with pytest.raises(SystemExit, match="no seeds"):
        pd_main(["--results", str(tmp_path / "nothing")])


def test_the_proxy_drops_idle_connections_before_the_engines_do() -> None:
    async def connector_idle_s() -> float:
        app = make_app(["http://127.0.0.1:1"], "round_robin")
        runner = web.AppRunner(app)
        await runner.setup()  # runs on_startup: the client session exists from here
        try:
            return float(app["state"].http.connector._keepalive_timeout)
        finally:
            await runner.cleanup()

    import uvicorn

    assert asyncio.run(connector_idle_s()) < uvicorn.Config(app=None).timeout_keep_alive
