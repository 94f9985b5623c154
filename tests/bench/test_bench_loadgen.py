"""The load generator against a real simulated engine on loopback (the sim, in a thread)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from dataclasses import replace

import pytest

from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.server import SimEngineThread
from kvroute.testbed.loadgen import LoadConfig, run_trace
from kvroute.testbed.stats import RequestRecord, summarize
from kvroute.testbed.textgen import TokenSpace
from kvroute.testbed.trace import TraceRequest
from kvroute.testbed.workload import PRESETS, generate

MODEL = "kvroute-sim"


@pytest.fixture(scope="module")
def trace() -> list[TraceRequest]:
    return generate(PRESETS["smoke"], TokenSpace.discover())


@pytest.fixture()
def engine() -> Iterator[SimEngineThread]:
    with SimEngineThread(EngineConfig(model=MODEL, speed=2.0)) as sim:
        yield sim


def _run(trace: list[TraceRequest], cfg: LoadConfig) -> list[RequestRecord]:
    return asyncio.run(run_trace(trace, cfg))


def test_open_loop_keeps_sessions_in_order_and_reads_usage(
    engine: SimEngineThread, trace: list[TraceRequest]
) -> None:
    recs = _run(trace, LoadConfig(url=engine.url, model=MODEL, time_scale=2.0))
    assert len(recs) == len(trace)
    assert all(r.ok for r in recs), [r.error for r in recs if not r.ok]
    by_id = {r.id: r for r in recs}
    for req in trace:
        rec = by_id[req.id]
        assert rec.ttft is not None and rec.latency is not None and rec.ttft <= rec.latency
        assert rec.sent >= rec.scheduled - 0.005  # never early
        assert rec.scheduled == pytest.approx(req.t / 2.0)
        assert rec.output_tokens == req.max_tokens  # ignore_eos: exactly what the trace asks
        assert rec.prompt_tokens is not None and rec.prompt_tokens >= req.prompt_tokens
        if req.turn > 0:
            prev = by_id[f"{req.session}-t{req.turn - 1:02d}"]
            assert prev.latency is not None
            # Not before the previous answer plus the (scaled) think time.
            assert rec.sent >= prev.sent + prev.latency + req.think_time - 0.005
            # One engine: a follow-up turn reuses at least the previous prompt's full blocks.
            assert rec.cached_tokens is not None and prev.prompt_tokens is not None
            assert rec.cached_tokens >= prev.prompt_tokens // 16 * 16 - 16
    s = summarize(recs, slo_ttft_s=10.0)
    assert s.cached_ratio > 0.3 and s.goodput_req_per_s == s.req_per_s > 0


def test_closed_loop_bounds_concurrency(engine: SimEngineThread, trace: list[TraceRequest]) -> None:
    cfg = LoadConfig(url=engine.url, model=MODEL, time_scale=None, concurrency=2, think_scale=0)
    recs = _run(trace, cfg)
    assert all(r.ok for r in recs) and len(recs) == len(trace)
    events = sorted(
        [(r.sent, 1) for r in recs] + [(r.sent + (r.latency or 0.0), -1) for r in recs],
        key=lambda e: (e[0], e[1]),
    )
    inflight = peak = 0
    for _, d in events:
        inflight += d
        peak = max(peak, inflight)
    assert peak == 2


def test_live_history_sends_the_engines_own_answers(
    engine: SimEngineThread, trace: list[TraceRequest]
) -> None:
    chat = [r for r in trace if r.session == "chat-0001"]
    assert len(chat) >= 2
    recs = _run(chat, LoadConfig(url=engine.url, model=MODEL, time_scale=None, live_history=True))
    assert all(r.ok for r in recs)
    # The engine cached its own answer, so the next turn hits beyond the previous prompt.
    first, second = recs[0], recs[1]
    assert first.prompt_tokens is not None and second.cached_tokens is not None
    assert second.cached_tokens > first.prompt_tokens // 16 * 16


def test_errors_and_deadline_are_recorded(
    engine: SimEngineThread, trace: list[TraceRequest]
) -> None:
    bad = [replace(trace[0], model="no-such-model")]
    (rec,) = _run(bad, LoadConfig(url=engine.url, model=MODEL))
    assert not rec.ok and rec.status == 404 and rec.error is not None
    assert summarize([rec], 1.0).error_kinds == {"http 404": 1}

    late = [replace(r, t=r.t + 5.0) for r in trace[:3]]
    assert _run(late, LoadConfig(url=engine.url, model=MODEL, deadline_s=0.5)) == []

    closed = LoadConfig(url="http://127.0.0.1:9", model=MODEL, request_timeout_s=2.0)
    (down,) = _run(trace[:1], closed)
    assert not down.ok and down.status is None and "Connect" in (down.error or "")


def test_records_name_the_engine_that_answered(trace: list[TraceRequest]) -> None:
    """A named simulated engine answers its name as `system_fingerprint` in the streamed usage
    chunk, with its timing; the record keeps the worker and splits the TTFT (unnamed engines,
    as vLLM, send neither)."""
    few = [r for r in trace if r.turn == 0][:3]
    with SimEngineThread(EngineConfig(model=MODEL, speed=2.0), name="sim-7") as named:
        recs = _run(few, LoadConfig(url=named.url, model=MODEL, time_scale=None, concurrency=3))
    assert [r.worker for r in recs] == ["sim-7"] * len(few)
    # ...and where its TTFT went: the parts are real intervals that add up to the TTFT.
    for r in recs:
        parts = (r.forward_s, r.parse_s, r.queue_s, r.prefill_s, r.return_s)
        assert all(p is not None and p >= 0 for p in parts), parts
        assert r.prefill_s and r.prefill_s > 0
        assert r.ttft is not None and abs(sum(p or 0.0 for p in parts) - r.ttft) < 1e-6
        assert r.pulled_blocks == 0  # a mixed engine pulls no KV from a prefill peer
    with SimEngineThread(EngineConfig(model=MODEL, speed=2.0)) as unnamed:
        recs = _run(few, LoadConfig(url=unnamed.url, model=MODEL, time_scale=None, concurrency=3))
    assert all(r.ok for r in recs) and [r.worker for r in recs] == [None] * len(few)
    assert all(r.forward_s is None and r.return_s is None for r in recs)
    assert all(r.pulled_blocks is None for r in recs)


def test_closed_loop_clients_hold_one_conversation_each(
    engine: SimEngineThread, trace: list[TraceRequest]
) -> None:
    """With N clients at most N conversations are live at once (from a conversation's first
    send to its last answer), every turn still waits for the previous answer, and waiting
    conversations start in trace order."""
    chats = [r for r in trace if r.kind == "chat"]
    cfg = LoadConfig(url=engine.url, model=MODEL, time_scale=None, clients=2, think_scale=0.1)
    recs = _run(chats, cfg)
    assert all(r.ok for r in recs) and len(recs) == len(chats)
    assert all(r.turn == int(r.id.rsplit("-t", 1)[1]) for r in recs)
    spans: dict[str, list[float]] = {}
    for r in recs:
        span = spans.setdefault(r.session, [math.inf, -math.inf])
        span[0] = min(span[0], r.sent)
        span[1] = max(span[1], r.sent + (r.latency or 0.0))
    events = sorted([(a, 1) for a, _ in spans.values()] + [(b, -1) for _, b in spans.values()])
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    assert peak == 2
    first_in_trace = [r.session for r in chats if r.turn == 0]
    first_sent = sorted(spans, key=lambda s: spans[s][0])
    assert first_sent[2:] == first_in_trace[2:]  # the first two start together
    by_id = {r.id: r for r in recs}
    for req in chats:
        if req.turn > 0:
            prev = by_id[f"{req.session}-t{req.turn - 1:02d}"]
            assert by_id[req.id].sent >= prev.sent + (prev.latency or 0.0)
