"""Async load generator for any OpenAI-compatible endpoint.

Replays a trace (:mod:`kvroute.testbed.trace`) in open loop (each request at its timestamp, scaled
by
``time_scale``) or closed loop (at most ``concurrency`` requests in flight, timestamps
ignored), or both (timestamps with a concurrency cap). In every mode a session's requests
go in order: a turn starts only after the previous turn's answer plus its think time.

With ``clients`` set, the replay is a closed loop of that many clients: each client holds one
conversation (session) at a time, sends its next turn when the previous answer arrived plus
the think time, and takes the next waiting conversation (in trace order) once its own ended.
At most ``clients`` conversations are live at once, however many the trace holds.

Every request streams (``stream_options.include_usage``), and the record keeps the time to
the first content chunk (TTFT), the end-to-end latency, the output tokens, and the
engine-reported ``usage.prompt_tokens_details.cached_tokens``.

``python -m kvroute.testbed.loadgen --url http://127.0.0.1:8000 --trace T.jsonl [--concurrency N]``
prints the summary as JSON and can write the records as JSONL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvroute.testbed.stats import RequestRecord, Summary, summarize
from kvroute.testbed.trace import TraceRequest, read_jsonl

# Response headers that name the worker a router picked (kvroute, the bench's own proxy).
WORKER_HEADERS = ("x-kvroute-worker", "x-bench-worker")


@dataclass(frozen=True)
class LoadConfig:
    """How to replay a trace."""

    url: str  # base URL, e.g. http://127.0.0.1:8000
    model: str  # used where a request names none
    time_scale: float | None = 1.0  # None = ignore timestamps (closed loop)
    concurrency: int | None = None  # None = unbounded (open loop)
    clients: int | None = None  # closed-loop clients, one live conversation each; None = any
    think_scale: float = 1.0  # multiplies think times (0 = none)
    request_timeout_s: float = 120.0
    deadline_s: float | None = None  # no request is sent after this (from the start)
    live_history: bool = False  # replace the trace's assistant answers by the real ones
    ignore_eos: bool = True  # vLLM extension: generate exactly max_tokens, as the trace says
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    session_header: str | None = "x-session-id"  # send the session id in this header


def build_body(
    req: TraceRequest, cfg: LoadConfig, messages: list[dict[str, str]] | None
) -> dict[str, Any]:
    """The OpenAI request body for ``req`` (streaming, usage requested)."""
    body: dict[str, Any] = {
        "model": req.model or cfg.model,
        "max_tokens": req.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if messages is not None:
        body["messages"] = messages
    else:
        body["prompt"] = req.prompt
    if req.cache_salt is not None:
        body["cache_salt"] = req.cache_salt
    if req.user is not None:
        body["user"] = req.user
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    return body


def _content_of(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "delta" in c:
        return str((c.get("delta") or {}).get("content") or "")
    return str(c.get("text") or "")


def _split_ttft(rec: RequestRecord, t0: float, timing: dict[str, Any]) -> None:
    """Fill the record's TTFT parts from an engine's timing (monotonic seconds; ``t0`` is
    ``time.perf_counter()`` at the send, the same clock on Linux). The timing comes with the
    last chunk, after the first content, so the TTFT is known."""
    marks = [timing.get(k) for k in ("received", "arrival", "admitted", "first_token")]
    if rec.ttft is None or not all(isinstance(m, float | int) for m in marks):
        return
    received, arrival, admitted, first = (float(m) for m in marks)  # type: ignore[arg-type]
    rec.forward_s = received - t0
    rec.parse_s = arrival - received
    rec.queue_s = admitted - arrival
    rec.prefill_s = first - admitted
    rec.return_s = t0 + rec.ttft - first
    pulled = timing.get("pulled_blocks")
    if isinstance(pulled, int) and not isinstance(pulled, bool) and pulled >= 0:
        rec.pulled_blocks = pulled


async def send_one(
    session: aiohttp.ClientSession,
    req: TraceRequest,
    cfg: LoadConfig,
    rec: RequestRecord,
    t_origin: float,
    messages: list[dict[str, str]] | None,
) -> str:
    """Send ``req`` and fill ``rec``; returns the generated text."""
    path = "/v1/chat/completions" if messages is not None else "/v1/completions"
    headers = dict(cfg.headers)
    if cfg.session_header:
        headers[cfg.session_header] = req.session
    body = build_body(req, cfg, messages)
    t0 = time.perf_counter()
    rec.sent = t0 - t_origin
    pieces: list[str] = []
    n_chunks = 0
    try:
        async with session.post(cfg.url.rstrip("/") + path, json=body, headers=headers) as resp:
            rec.status = resp.status
            for h in WORKER_HEADERS:
                if h in resp.headers:
                    rec.worker = resp.headers[h]
            if resp.status != 200:
                text = await resp.text()
                rec.error = f"http {resp.status}: {text[:200]}"
                return ""
            buf = b""
            async for raw in resp.content:
                buf += raw
                if not buf.endswith(b"\n"):
                    continue  # an SSE line split across reads
                line, buf = buf.strip(), b""
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"stream error: {str(chunk['error'])[:200]}"
                    break
                content = _content_of(chunk)
                if content:
                    if rec.ttft is None:
                        rec.ttft = time.perf_counter() - t0
                    pieces.append(content)
                    n_chunks += 1
                usage = chunk.get("usage")
                if rec.worker is None and chunk.get("system_fingerprint"):
                    rec.worker = str(chunk["system_fingerprint"])  # a named simulated engine
                timing = chunk.get("kvroute_engine_timing")
                if timing:
                    _split_ttft(rec, t0, timing)
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens")
                    rec.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = int(details.get("cached_tokens") or 0)
            rec.latency = time.perf_counter() - t0
            if rec.ttft is None and rec.error is None:
                rec.error = "no content"
            if rec.output_tokens == 0:
                rec.output_tokens = n_chunks
    except TimeoutError:
        rec.error = "timeout"
    except (aiohttp.ClientError, json.JSONDecodeError, OSError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    return "".join(pieces)


@dataclass
class _SessionState:
    done: dict[int, asyncio.Event] = field(default_factory=dict)
    finished_at: dict[int, float] = field(default_factory=dict)
    seated: bool = False  # a closed-loop client holds this conversation
    answers: dict[int, str] = field(default_factory=dict)  # message index -> real answer


def _with_answers(req: TraceRequest, st: _SessionState) -> list[dict[str, str]] | None:
    if req.messages is None:
        return None
    msgs = [dict(m) for m in req.messages]
    for idx, text in st.answers.items():
        if idx < len(msgs) and msgs[idx].get("role") == "assistant":
            msgs[idx]["content"] = text
    return msgs


async def run_trace(
    trace: Sequence[TraceRequest],
    cfg: LoadConfig,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """Replay ``trace`` against ``cfg.url``; returns one record per request that was sent."""
    sessions: dict[str, _SessionState] = {}
    for req in trace:
        st = sessions.setdefault(req.session, _SessionState())
        st.done[req.turn] = asyncio.Event()
    prev_turn: dict[str, int] = {}
    predecessor: dict[str, int | None] = {}
    for req in sorted(trace, key=lambda r: (r.session, r.turn)):
        predecessor[req.id] = prev_turn.get(req.session)
        prev_turn[req.session] = req.turn

    last_turn: dict[str, int] = {}
    for req in trace:
        last_turn[req.session] = max(req.turn, last_turn.get(req.session, req.turn))
    sem = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
    # asyncio.Semaphore wakes waiters in FIFO order: conversations start in trace order
    seats = asyncio.Semaphore(cfg.clients) if cfg.clients else None
    records: list[RequestRecord] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    loop = asyncio.get_running_loop()
    t_origin = time.perf_counter()
    l_origin = loop.time()

    async def one(req: TraceRequest) -> None:
        st = sessions[req.session]
        scheduled = 0.0 if cfg.time_scale is None else req.t / cfg.time_scale
        prev = predecessor[req.id]
        try:
            if cfg.deadline_s is not None and scheduled > cfg.deadline_s:
                return  # would start after the deadline: do not wait for it
            await asyncio.sleep(max(0.0, l_origin + scheduled - loop.time()))
            if seats is not None and prev is None:
                await seats.acquire()  # a client takes this conversation
                st.seated = True
            if prev is not None:
                await st.done[prev].wait()
                ready = st.finished_at[prev] + req.think_time * cfg.think_scale
                await asyncio.sleep(max(0.0, ready - loop.time()))
            if cfg.deadline_s is not None and loop.time() - l_origin > cfg.deadline_s:
                return
            rec = RequestRecord(
                id=req.id, session=req.session, kind=req.kind, scheduled=scheduled, turn=req.turn
            )
            msgs = _with_answers(req, st) if cfg.live_history else req.messages
            if sem is not None:
                async with sem:
                    text = await send_one(http, req, cfg, rec, t_origin, msgs)
            else:
                text = await send_one(http, req, cfg, rec, t_origin, msgs)
            if cfg.live_history and req.messages is not None and rec.ok:
                st.answers[len(req.messages)] = text
            records.append(rec)
            if on_done is not None:
                on_done(rec)
        finally:
            st.finished_at[req.turn] = loop.time()
            st.done[req.turn].set()
            if seats is not None and st.seated and req.turn == last_turn[req.session]:
                seats.release()  # the conversation ended: its client takes the next one

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        await asyncio.gather(*(one(r) for r in trace))
    records.sort(key=lambda r: (r.sent if not math.isnan(r.sent) else math.inf, r.id))
    return records


def progress_printer(
    total: int, every: int = 25, stream: Any = None
) -> Callable[[RequestRecord], None]:
    """A callback that prints a progress line every ``every`` finished requests."""
    out = stream if stream is not None else sys.stderr
    count = {"n": 0, "err": 0}

    def cb(rec: RequestRecord) -> None:
        count["n"] += 1
        count["err"] += 0 if rec.ok else 1
        if count["n"] % every == 0 or count["n"] == total:
            print(f"  {count['n']}/{total} done, {count['err']} errors", file=out, flush=True)

    return cb


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvroute.testbed.loadgen", description=__doc__)
    p.add_argument("--url", required=True)
    p.add_argument("--trace", required=True, help="kvroute JSONL trace")
    p.add_argument("--model", default="default")
    p.add_argument("--concurrency", type=int, default=None, help="closed loop with N in flight")
    p.add_argument("--time-scale", type=float, default=1.0, help="open loop speed-up")
    p.add_argument("--closed", action="store_true", help="ignore timestamps")
    p.add_argument(
        "--clients",
        type=int,
        default=None,
        help="closed loop of N clients, each one conversation at a time (with --closed)",
    )
    p.add_argument("--think-scale", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--deadline", type=float, default=None)
    p.add_argument("--live-history", action="store_true")
    p.add_argument("--slo-ttft", type=float, default=1.0)
    p.add_argument("--records", default=None, help="write per-request records (JSONL) here")
    args = p.parse_args(argv)
    trace = read_jsonl(args.trace)
    cfg = LoadConfig(
        url=args.url,
        model=args.model,
        time_scale=None if args.closed else args.time_scale,
        concurrency=args.concurrency,
        clients=args.clients,
        think_scale=args.think_scale,
        request_timeout_s=args.timeout,
        deadline_s=args.deadline,
        live_history=args.live_history,
    )
    records = asyncio.run(run_trace(trace, cfg, progress_printer(len(trace))))
    summary: Summary = summarize(records, args.slo_ttft)
    if args.records:
        with open(args.records, "w", encoding="utf-8") as out:
            for r in records:
                out.write(json.dumps(r.to_json()) + "\n")
    print(json.dumps(summary.to_json(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
