"""The OpenAI proxy: one ASGI endpoint per API route, forwarding to the chosen worker.

Per request: read the body (bounded), check it, resolve the model, get token ids, decide,
send upstream. Failures before the first byte reaches the client (connect error, timeout,
5xx, 429) are retried on another worker with backoff, within the retry budget; after the first
byte nothing is retried, and an upstream failure mid-stream becomes an SSE error event and a
clean close. A client that disconnects cancels the upstream request (its connection is
dropped, so the engine aborts it). Streams are forwarded event by event as they arrive; `send`
waits for the client socket, so a slow client slows the upstream read (backpressure).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from kvroute.ratelog import RateLimitedLog
from kvroute.router.config import RouterConfig
from kvroute.router.edge.attempt import (
    DecodeHalf,
    Exchange,
    Failure,
    Failures,
    Outgoing,
    Send,
    response_headers,
)
from kvroute.router.edge.body import BodyBudget, BodyReader, ClientGone
from kvroute.router.edge.chat_answer import AnswerTap, answer_of_response
from kvroute.router.edge.chat_as_completion import ChatStream, chat_response, completion_body
from kvroute.router.edge.completion_as_ids import completion_ids_body
from kvroute.router.edge.errors import (
    INVALID_FIELD,
    MID_STREAM,
    NO_WORKER,
    OVERLOADED,
    UPSTREAM,
    RouterError,
    error_body,
    sse_error,
)
from kvroute.router.edge.openai_request import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    RESPONSES,
    ClientRequest,
    parse_request,
    with_stream_usage,
)
from kvroute.router.edge.pd_attempt import TwoPhaseAttempt
from kvroute.router.edge.pd_wire import splittable
from kvroute.router.edge.prefill_watch import ResponsesPrefillWatch
from kvroute.router.edge.retry import Backoff, RetryBudget, retryable_status
from kvroute.router.edge.sse import SseFilter, Usage, usage_from_json
from kvroute.router.edge.trust import TrustedPeers, peer_of
from kvroute.router.edge.upstream import (
    Upstream,
    UpstreamConnectError,
    UpstreamError,
    UpstreamPoolTimeout,
    UpstreamResponse,
    UpstreamTimeout,
)
from kvroute.router.fleet.load import LoadTicket, PrefillRateEstimate, PromptSizeEstimate
from kvroute.router.fleet.step_clock import StepClock
from kvroute.router.fleet.verify import Verifier
from kvroute.router.fleet.workers import PREFILL, Worker, WorkerRegistry
from kvroute.router.ops.decisions import DecisionLog, DecisionRecord, PhaseAttempt
from kvroute.router.ops.metrics import RouterMetrics
from kvroute.router.routing.pipeline import Prompt, Routing
from kvroute.router.routing.policy import Candidate

log = logging.getLogger("kvroute.router.proxy")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Any]

_JSON = [(b"content-type", b"application/json")]


# Sending a request that reached the engine again could run it twice: only embeddings, which
# generate nothing, are retried after a failure once the request was sent.
_RETRY_AFTER_SEND = frozenset({EMBEDDINGS})

# With `send_token_ids`, endpoint -> (the body as a completion of the prompt's ids or None,
# whether the completion answer goes back to the client in chat shape).
_AS_IDS: dict[str, tuple[Callable[[dict[str, Any], Sequence[int]], bytes | None], bool]] = {
    CHAT: (completion_body, True),
    COMPLETIONS: (completion_ids_body, False),
}


class _StallWatch:
    """Wraps a request's ASGI `send`: when one send has waited longer than `stall_s` for a
    client that does not read, the handling task is cancelled (so the upstream connection is
    dropped and freed). One timer per request, started at the first send."""

    __slots__ = ("_loop", "_send", "_stall_s", "_task", "_timer", "since", "stalled")

    def __init__(self, send: Send, stall_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._send = send
        self._stall_s = stall_s
        self._timer: asyncio.TimerHandle | None = None
        self.since: float | None = None  # when the pending send began
        self.stalled = False

    async def send(self, message: dict[str, Any]) -> None:
        self.since = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_later(self._stall_s, self._check)
        await self._send(message)
        self.since = None

    def _check(self) -> None:
        since = self.since
        waited = 0.0 if since is None else self._loop.time() - since
        if waited >= self._stall_s and self._task is not None:
            self.stalled = True
            self._timer = None
            self._task.cancel()
            return
        self._timer = self._loop.call_later(self._stall_s - waited, self._check)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


# A client that disconnects is noticed by a task waiting on `receive()`. Most requests are
# over before this; the watch starts only then, so they never pay for that task (a
# disconnect earlier than this is acted on when the watch starts: `receive()` reports it).
_WATCH_AFTER_S = 0.05


class _DisconnectWatch:
    """Cancels the handling task when the client goes away (started late, see above)."""

    __slots__ = ("_handler", "_receive", "_task", "_timer", "gone")

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._handler = asyncio.current_task()
        self._task: asyncio.Task[None] | None = None
        self.gone = False
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            _WATCH_AFTER_S, self._start
        )

    def _start(self) -> None:
        self._timer = None
        self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                if self._handler is not None:
                    self._handler.cancel()
                return

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None:
            self._task.cancel()


class Proxy:
    def __init__(
        self,
        cfg: RouterConfig,
        routing: Routing,
        upstream: Upstream,
        registry: WorkerRegistry,
        verifier: Verifier,
        decisions: DecisionLog,
        metrics: RouterMetrics,
        prompt_size: PromptSizeEstimate,
        clock: Callable[[], float] = time.monotonic,
        prefill_rate: PrefillRateEstimate | None = None,
        bodies: BodyReader | None = None,
    ) -> None:
        self._cfg = cfg
        self._routing = routing
        self._upstream = upstream
        self._registry = registry
        self._verifier = verifier
        self._decisions = decisions
        self._metrics = metrics
        self._prompt_size = prompt_size
        self._prefill_rate = prefill_rate
        self._clock = clock
        self._budget = RetryBudget(cfg.retry.budget_ratio, cfg.retry.budget_min_per_s)
        self._backoff = Backoff(cfg.retry)
        self._in_flight = 0
        self._seq = 0
        edge = cfg.edge
        self.bodies = bodies or BodyReader(
            cfg.limits.max_body_bytes,
            BodyBudget(edge.body_bytes_in_flight),
            edge.body_read_s,
            cfg.timeouts.retry_after_s,
        )
        self._trusted = TrustedPeers(edge.trusted_proxies)
        self._write_stall_s = edge.write_stall_s
        self._deadline_s = edge.request_deadline_s
        self._show_headers = cfg.admin.response_headers
        self._ratelog = RateLimitedLog(log, interval_s=10.0)
        self._failures = Failures(metrics, clock, cfg.timeouts.retry_after_s, self._deadline_s)
        self._two_phase = TwoPhaseAttempt(
            routing=routing,
            upstream=upstream,
            registry=registry,
            metrics=metrics,
            prompt_size=prompt_size,
            budget=self._budget,
            failures=self._failures,
            decode=self._attempt,
            max_attempts=cfg.retry.max_attempts,
            retry_after_s=cfg.timeouts.retry_after_s,
            ratelog=self._ratelog,
            clock=clock,
        )
        self._remember_answers = cfg.tokenizer.remember_answers

    def _prefill_done_after(self, est_ttft_s: float) -> float:
        """When a request's queued prefill is taken as done if no byte came back first: its
        estimated TTFT, in wall time at the measured rate with `load.release_at_measured_rate`
        (from whatever rate the load model estimated it at)."""
        rate = self._prefill_rate
        if rate is not None and self._cfg.load.release_at_measured_rate:
            estimated_at = 1.0 / self._routing.policy.load_model.seconds_per_token()
            est_ttft_s = rate.wall_seconds(est_ttft_s, estimated_at)
        return max(est_ttft_s, 0.001)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def endpoint(self, path: str) -> ProxyEndpoint:
        return ProxyEndpoint(self, path)

    # -- one request ------------------------------------------------------------------
    async def handle(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        status = 500
        self._in_flight += 1
        watch: _DisconnectWatch | None = None
        stall = _StallWatch(send, self._write_stall_s)
        send = stall.send
        lease = self.bodies.lease()
        try:
            if self._in_flight > self._cfg.limits.max_in_flight:
                raise RouterError(
                    OVERLOADED,
                    "router overloaded: too many requests in flight",
                    retry_after=self._cfg.timeouts.retry_after_s,
                )
            raw = await self.bodies.read(scope["headers"], receive, lease)
            watch = _DisconnectWatch(receive)
            status = await self._route_and_forward(path, raw, scope, send)
        except RouterError as exc:
            status = exc.kind.status
            self._metrics.child(self._metrics.errors, exc.kind.kind).inc()
            self._ratelog.warning(exc.kind.kind, "%s %s: %s", status, path, exc.message)
            await _send_error(send, exc)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            gone = watch is not None and watch.gone
            if not (gone or stall.stalled) or task is None:
                raise
            task.uncancel()
            status = 499
            if gone:
                self._metrics.disconnects.inc()
            else:
                self._metrics.child(self._metrics.errors, "write_stall").inc()
                self._ratelog.warning(
                    "write_stall", "%s: client read nothing for %g s", path, self._write_stall_s
                )
        except ClientGone:
            status = 499
            self._metrics.disconnects.inc()
        finally:
            self._in_flight -= 1
            lease.release()
            stall.stop()
            if watch is not None:
                watch.stop()
            self._metrics.child(self._metrics.requests, path, str(status)).inc()
            self._metrics.child(self._metrics.duration, path).observe(time.perf_counter() - started)

    async def _route_and_forward(self, path: str, raw: bytes, scope: Scope, send: Send) -> int:
        routing = self._routing
        req = parse_request(path, raw, scope["headers"], peer_of(scope) in self._trusted)
        route = routing.resolve_model(req)
        if not routing.any_eligible(route):
            raise RouterError(
                NO_WORKER,
                f"no healthy worker can serve model `{route.name}` right now",
                retry_after=self._cfg.timeouts.retry_after_s,
            )
        # A stream's new turn is encoded after dispatch (`_complete`), off the critical path,
        # unless the engine is to be sent the whole ids.
        send_ids = req.endpoint in _AS_IDS and routing.sends_token_ids(route)
        split = splittable(req.endpoint, req.body)
        if not split and not routing.eligible(route, split=False):
            raise RouterError(
                INVALID_FIELD,
                f"model `{route.name}` is served by prefill/decode workers now, which take one "
                "prompt with n=1 on /v1/completions or /v1/chat/completions",
            )
        prompt = await routing.prompt(req, route, partial=req.stream and not send_ids)
        reuse = routing.reuse(prompt)
        decision = routing.decide(req, route, prompt, reuse, split=split)
        self._seq += 1
        record = self._decisions.add(
            f"kvr-{self._seq}",
            path,
            route.name,
            prompt.lora_name,
            bool(prompt.cache_salt),
            prompt.source,
            decision,
        )
        inject_usage = req.stream and not req.wants_usage and path in (CHAT, COMPLETIONS)
        out = self._as_ids(req, prompt, inject_usage) if send_ids else None
        if out is None:
            body = with_stream_usage(req.body, req.raw) if inject_usage else req.raw
            out = Outgoing(req.endpoint, body, inject_usage)
        if self._remember_answers:
            out = replace(out, keep_answer_for=routing.answer_target(req, route, prompt))
        record.upstream_endpoint = out.path
        if inject_usage:
            self._metrics.usage_injected.inc()
        self._budget.on_request()
        started = time.perf_counter()
        try:
            return await self._forward(req, prompt, record, out, send)
        finally:
            record.duration_s = time.perf_counter() - started

    def _as_ids(self, req: ClientRequest, prompt: Prompt, inject_usage: bool) -> Outgoing | None:
        """The request as a completion of its exact token ids, when it can be sent so."""
        convert, as_chat = _AS_IDS[req.endpoint]
        sent = self._metrics.sent_as_ids
        ids = prompt.token_ids
        if prompt.source == "request":  # the client sent ids: nothing to convert
            self._metrics.child(sent, req.endpoint, "given_ids").inc()
            return None
        if ids is None or prompt.partial is not None or prompt.source not in ("local", "render"):
            self._metrics.child(sent, req.endpoint, "no_exact_ids").inc()
            return None
        body = req.body
        if inject_usage:
            body = {**body, "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": False}}  # fmt: skip
        converted = convert(body, ids)
        if converted is None:
            self._metrics.child(sent, req.endpoint, "not_plain").inc()
            return None
        self._metrics.child(sent, req.endpoint, "yes").inc()
        return Outgoing(COMPLETIONS, converted, inject_usage, as_chat=as_chat)

    async def _forward(
        self,
        req: ClientRequest,
        prompt: Prompt,
        record: DecisionRecord,
        out: Outgoing,
        send: Send,
    ) -> int:
        tried: list[str] = []
        cand = record.decision.chosen
        assert cand is not None
        retries = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._deadline_s  # bounds every attempt until the first byte
        exchange = Exchange(req, prompt, record, out, send, deadline)
        while True:
            worker = cand.worker
            tried.append(worker.name)
            record.attempts.append(worker.name)
            result = await self._attempt(worker, cand, exchange)
            if isinstance(result, int):
                return result
            failure = result
            if failure.final or retries + 1 >= self._cfg.retry.max_attempts:
                return await self._give_up(failure, record, send)
            if not self._budget.try_spend(self._clock()):
                self._metrics.retry_budget_exhausted.inc()
                return await self._give_up(failure, record, send)
            retries += 1
            pause = self._backoff.delay(retries)
            if loop.time() + pause >= deadline:
                return await self._give_up(self._failures.past_deadline(), record, send)
            await asyncio.sleep(pause)
            route = self._routing.resolve_model(req)
            try:
                decision = self._routing.decide(
                    req, route, prompt, self._routing.reuse(prompt), exclude=tried,
                    split=splittable(req.endpoint, req.body),
                )  # fmt: skip
            except RouterError:
                return await self._give_up(failure, record, send)
            self._metrics.child(self._metrics.retries, failure.cause).inc()
            cand = decision.chosen
            assert cand is not None

    async def _give_up(self, failure: Failure, record: DecisionRecord, send: Send) -> int:
        if failure.upstream is not None:
            status, headers, data = failure.upstream
            record.status = status
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": data})
            return status
        error = failure.error or RouterError(UPSTREAM, "upstream failed")
        record.status = error.kind.status
        self._metrics.child(self._metrics.errors, error.kind.kind).inc()
        self._ratelog.warning(error.kind.kind, "giving up: %s", error.message)
        await _send_error(send, error)
        return error.kind.status

    async def _attempt(
        self,
        worker: Worker,
        cand: Candidate,
        exchange: Exchange,
        half: DecodeHalf | None = None,
    ) -> int | Failure:
        """One try on one worker: an HTTP status once the client got an answer, or a failure.
        A prefill worker's try runs both halves of the request (`TwoPhaseAttempt`); `half` is
        the decode half's try."""
        if worker.spec.role == PREFILL and half is None:
            return await self._two_phase.run(worker, cand, exchange)
        req, prompt, record, out = exchange.req, exchange.prompt, exchange.record, exchange.out
        send, deadline = exchange.send, exchange.deadline
        metrics = self._metrics
        breaker = worker.breaker
        breaker.on_send(self._clock())
        ticket = LoadTicket(worker.load, cand.uncached)
        if half is None:
            self._prompt_size.observe(cand.uncached)
        self._routing.expect(worker, prompt)
        # The prefill is taken as done at the first byte or at the estimated TTFT (in wall
        # time at the measured rate, `_prefill_done_after`), whichever comes first. (Holding
        # a stream's queued tokens until its first byte, the exact end of prefill in vLLM,
        # together with routing at the learned rate balanced load more and reused less on
        # the routing benchmark.)
        prefill_timer = asyncio.get_running_loop().call_later(
            self._prefill_done_after(cand.est_ttft_s), ticket.prefill_done
        )
        headers = req.headers
        if worker.url_shared:
            headers = [*headers, ("x-data-parallel-rank", str(worker.spec.dp_rank))]
        dispatched = time.perf_counter()
        # of the whole prompt (`_complete` rescores a partial one), lower tiers included
        predicted = cand.predicted_cached if half is None else half.predicted
        body = out.body if half is None else half.body
        # a Responses stream's first byte precedes its prefill: watch for the end instead
        watch = ResponsesPrefillWatch() if req.stream and out.path == RESPONSES else None
        resp: UpstreamResponse | None = None
        verdict = False
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    url = worker.url + out.path
                    resp = await self._upstream.send("POST", url, headers, body)
                    if resp.status == 429 or retryable_status(resp.status):
                        data = await resp.read()
                        resp.release()
                        metrics.child(
                            metrics.upstream, worker.name, f"{resp.status // 100}xx"
                        ).inc()
                        if resp.status >= 500:
                            breaker.record_failure(self._clock())
                        else:
                            breaker.release()
                        verdict = True
                        cause = "429" if resp.status == 429 else "5xx"
                        return Failure(cause, None, (resp.status, response_headers(resp), data))
                    if req.stream and resp.status == 200:
                        if prompt.partial is not None:
                            predicted = await self._complete(worker, cand, prompt, record)
                        first = await resp.next_chunk()
                        if watch is None or watch.feed(first):
                            # a decode's first byte ends no prefill of its own
                            self._prefill_ended(worker, cand, dispatched, rate=half is None)
                    else:
                        first = await resp.read()
            except UpstreamPoolTimeout as exc:
                return self._failures.pool_wait(exc)
            except UpstreamError as exc:
                verdict = True
                final = exc.sent and req.endpoint not in _RETRY_AFTER_SEND
                return self._failures.upstream(worker, exc, final=final)
            except TimeoutError:
                metrics.child(metrics.upstream, worker.name, "timeout").inc()
                return self._failures.past_deadline()
            # From here on the client gets this worker's answer: no more retries.
            first_byte_s = time.perf_counter() - dispatched
            breaker.record_success()
            verdict = True
            prefill_to_come = None
            if watch is None or watch.done:
                ticket.prefill_done()
            else:
                ended = partial(self._prefill_ended, worker, cand, dispatched, ticket)
                prefill_to_come = (watch, ended)

            metrics.child(metrics.ttfb, worker.name).observe(first_byte_s)
            metrics.child(metrics.upstream, worker.name, f"{resp.status // 100}xx").inc()
            record.status = resp.status
            out_headers = response_headers(resp)
            if self._show_headers:
                out_headers += [
                    (b"x-kvroute-worker", worker.name.encode()),
                    (b"x-kvroute-predicted-cached-tokens", str(predicted or 0).encode()),
                ]
            tap = AnswerTap() if out.keep_answer_for is not None else None
            if req.stream and resp.status == 200:
                usage = await self._stream(
                    resp, first, out_headers, out, send, record, worker.load.steps, tap,
                    prefill_to_come,
                )  # fmt: skip
            else:
                resp.release()
                await send(
                    {"type": "http.response.start", "status": resp.status, "headers": out_headers}
                )
                usage = usage_from_json(first) if resp.status == 200 else None
                if out.as_chat and resp.status == 200:
                    first = chat_response(first)
                await send({"type": "http.response.body", "body": first})
            if half is not None:
                assert record.pd is not None
                record.pd.decode.append(PhaseAttempt(worker.name, str(resp.status), first_byte_s))
                if req.stream and resp.status == 200:
                    # a whole (non-streamed) answer's time is its decode's, not the pull's
                    metrics.child(metrics.pd_phase_seconds, "decode_first_byte").observe(
                        first_byte_s
                    )
                    self._routing.decode_started(cand.uncached, first_byte_s)
            if resp.status == 200:
                verify_as = worker if half is None else half.prefill
                self._verify(verify_as, predicted, req, prompt, record, usage)
                if tap is not None and out.keep_answer_for is not None and record.status == 200:
                    # the text is taken from the bytes later, on the tokenizer's answer thread
                    answer_of = tap.answer if req.stream else partial(answer_of_response, first)
                    self._routing.remember_answer(out.keep_answer_for, req.body, answer_of)
            return resp.status
        finally:
            prefill_timer.cancel()
            ticket.finish()
            if not verdict:
                breaker.release()
            if resp is not None:
                resp.abort()  # no-op once released; drops a half-read connection
            self._registry.request_finished(worker)

    def _prefill_ended(
        self,
        worker: Worker,
        cand: Candidate,
        dispatched: float,
        ticket: LoadTicket | None = None,
        rate: bool = True,
    ) -> None:
        """A stream's prefill just ended (its first output arrived): a step of the worker's
        clock, a sample of its prefill rate (unless not `rate`), and `ticket`'s queued
        prefill released."""
        if ticket is not None:
            ticket.prefill_done()
        worker.load.steps.observe(self._clock())
        if self._prefill_rate is not None and rate:
            self._prefill_rate.observe(
                cand.queued_tokens + cand.uncached, time.perf_counter() - dispatched
            )

    async def _complete(
        self, worker: Worker, cand: Candidate, prompt: Prompt, record: DecisionRecord
    ) -> int | None:
        """Finish a partial prompt while the engine prefills it: the whole ids, the chosen
        worker's expectation, and its prediction for the whole prompt (returned: what the
        verifier and the response header report; the decision log's predicted tokens too).
        The candidates keep the picture the policy decided on. On failure: the candidate's."""
        try:
            if not await self._routing.complete(prompt):
                return cand.predicted_cached
            predicted = self._routing.reuse(prompt).get(worker.name)
            tier = (prompt.tiers or {}).get(worker.name)
            if predicted is not None and tier is not None:
                predicted += tier.total
            if record.decision.chosen is cand:
                record.decision.predicted_reuse = predicted or 0
            self._routing.expect(worker, prompt)
            return predicted
        except Exception as exc:  # the request is already with the engine: never fail it here
            self._ratelog.error("complete", "finishing a partial prompt failed: %r", exc)
            self._metrics.child(self._metrics.errors, "tokenize").inc()
            return cand.predicted_cached

    async def _stream(
        self,
        resp: UpstreamResponse,
        first: bytes,
        headers: list[tuple[bytes, bytes]],
        outgoing: Outgoing,
        send: Send,
        record: DecisionRecord,
        steps: StepClock,
        tap: AnswerTap | None = None,
        prefill: tuple[ResponsesPrefillWatch, Callable[[], None]] | None = None,
    ) -> Usage | None:
        """Relay the stream; each chunk's arrival also ticks the worker's step clock (an
        engine step's end sends every running stream a chunk). `prefill`: a watch for the
        prefill's end still to come, and what to call then."""
        sse = SseFilter(strip_usage_chunk=outgoing.inject_usage)
        chat = ChatStream() if outgoing.as_chat else None
        clock = self._clock
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        chunk = first
        out = b""
        try:
            while chunk:
                out = sse.feed(chunk)
                if chat is not None:
                    out = chat.convert(out)
                if tap is not None:
                    tap.feed(out)
                if resp.at_end:
                    break  # the last piece: sent below with the end of the body, in one write
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                out = b""
                chunk = await resp.next_chunk()
                if prefill is not None and prefill[0].feed(chunk):
                    prefill[1]()
                    prefill = None
                    continue  # the step was observed with the prefill's end
                steps.observe(clock())
        except (UpstreamConnectError, UpstreamTimeout) as exc:
            self._metrics.child(self._metrics.errors, MID_STREAM.kind).inc()
            self._ratelog.warning(MID_STREAM.kind, "upstream failed mid-stream: %s", exc)
            record.status = MID_STREAM.status
            tail = sse.flush()
            if tail and not tail.endswith(b"\n\n"):
                tail = b""  # a truncated event would corrupt the error event after it
            if chat is not None:
                tail = chat.convert(tail)
            await send(
                {
                    "type": "http.response.body",
                    "body": tail + sse_error(f"upstream failed mid-stream: {exc}"),
                    "more_body": False,
                }
            )
            return None
        resp.release()
        rest = sse.flush()
        if chat is not None:
            rest = chat.convert(rest)
        if tap is not None:
            tap.feed(rest)
        await send({"type": "http.response.body", "body": out + rest, "more_body": False})
        return sse.usage

    def _verify(
        self,
        worker: Worker,
        predicted: int | None,
        req: ClientRequest,
        prompt: Prompt,
        record: DecisionRecord,
        usage: Usage | None,
    ) -> None:
        if usage is None:
            return
        record.reported_cached_tokens = usage.cached_tokens
        record.reported_prompt_tokens = usage.prompt_tokens
        if not _single_prompt(req):
            return
        record.outcome = self._verifier.observe(
            worker.name,
            predicted,
            usage.cached_tokens,
            usage.prompt_tokens,
            len(prompt.token_ids) if prompt.token_ids is not None else None,
        )


class ProxyEndpoint:
    """ASGI app for one OpenAI path (POST only)."""

    def __init__(self, proxy: Proxy, path: str) -> None:
        self._proxy = proxy
        self._path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._proxy.handle(self._path, scope, receive, send)


def _single_prompt(req: ClientRequest) -> bool:
    """Usage is comparable with one prediction only for one prompt and one choice."""
    n = req.body.get("n", 1)
    if isinstance(n, int) and n > 1:
        return False
    if req.endpoint == COMPLETIONS:
        prompt = req.body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return len(prompt) == 1
    return req.endpoint in (CHAT, COMPLETIONS, RESPONSES)


async def _send_error(send: Send, exc: RouterError) -> None:
    headers = list(_JSON)
    if exc.retry_after is not None:
        headers.append((b"retry-after", str(exc.retry_after).encode()))
    body = error_body(exc.message, exc.kind.type, exc.kind.status, exc.param, exc.code)
    try:
        await send({"type": "http.response.start", "status": exc.kind.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    except OSError:
        pass
