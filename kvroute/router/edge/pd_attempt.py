"""The two-phase attempt of a request on a prefill/decode fleet.

The policy chose a prefill worker. The prefill half goes there (`pd_wire.prefill_body`); its
answer's `kv_transfer_params` go with the client's request to the decode worker that holds
most of the prompt at the least load (`Routing.choose_decode`), which pulls the rest and
answers the client. A decode that fails before its first byte is retried on another decode
worker with the same params, within the retry budget; a prefill that fails is a failure of the
whole attempt (nothing reached the client), which the proxy may retry on another prefill
worker. The decode half itself is an ordinary single-worker attempt of the proxy (passed in as
`DecodeAttempt`), so streaming, verification and cancelling are the same as for any request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvroute.ratelog import RateLimitedLog
from kvroute.router.edge.attempt import (
    DecodeHalf,
    Exchange,
    Failure,
    Failures,
    Outgoing,
    response_headers,
)
from kvroute.router.edge.errors import NO_WORKER, UPSTREAM, RouterError
from kvroute.router.edge.openai_request import ClientRequest
from kvroute.router.edge.pd_wire import HandoffError, decode_body, handoff_params, prefill_body
from kvroute.router.edge.retry import RetryBudget, retryable_status
from kvroute.router.edge.upstream import Upstream, UpstreamError, UpstreamPoolTimeout
from kvroute.router.fleet.load import LoadTicket, PromptSizeEstimate
from kvroute.router.fleet.workers import Worker, WorkerRegistry
from kvroute.router.ops.decisions import PdRecord, PhaseAttempt
from kvroute.router.ops.metrics import RouterMetrics
from kvroute.router.routing.pipeline import Prompt, Routing
from kvroute.router.routing.policy import Candidate


class DecodeAttempt(Protocol):
    """The proxy's single-worker attempt, run as a request's decode half."""

    async def __call__(
        self, worker: Worker, cand: Candidate, exchange: Exchange, half: DecodeHalf | None = None
    ) -> int | Failure: ...


class TwoPhaseAttempt:
    """Runs both halves of a disaggregated request (see the module doc)."""

    def __init__(
        self,
        *,
        routing: Routing,
        upstream: Upstream,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        prompt_size: PromptSizeEstimate,
        budget: RetryBudget,
        failures: Failures,
        decode: DecodeAttempt,
        max_attempts: int,
        retry_after_s: int,
        ratelog: RateLimitedLog,
        clock: Callable[[], float],
    ) -> None:
        self._routing = routing
        self._upstream = upstream
        self._registry = registry
        self._metrics = metrics
        self._prompt_size = prompt_size
        self._budget = budget
        self._failures = failures
        self._decode = decode
        self._max_attempts = max_attempts
        self._retry_after_s = retry_after_s
        self._ratelog = ratelog
        self._clock = clock

    async def run(self, worker: Worker, cand: Candidate, exchange: Exchange) -> int | Failure:
        """Both halves of a disaggregated request: the prefill on `worker` (the policy's
        choice), then the decode on the decode worker that holds most of the prompt at the
        least load, retried on another decode worker with the same params if it fails
        before its first byte. A prefill that fails is a failure of this attempt (nothing
        reached the client, so the proxy may retry on another prefill worker)."""
        req, prompt, record, out = exchange.req, exchange.prompt, exchange.record, exchange.out
        pd = record.pd = record.pd or PdRecord()
        metrics = self._metrics
        if prompt.partial is not None and await self._routing.complete(prompt):
            cand.reuse = self._routing.reuse(prompt).get(worker.name)
        prefilled = await self._prefill(worker, cand, req, prompt, pd, out, exchange.deadline)
        if isinstance(prefilled, Failure):
            metrics.child(metrics.pd_retries, "prefill", prefilled.cause).inc()
            return prefilled
        route = self._routing.resolve_model(req)
        body = decode_body(out.body, prefilled)
        half = DecodeHalf(body, worker, cand.predicted_cached)
        tried: list[str] = []
        result: int | Failure = Failure("no_decode", None)
        for _ in range(self._max_attempts):
            choice = self._routing.choose_decode(
                route, prompt, self._routing.reuse(prompt), exclude=tried
            )
            if choice.chosen is None:
                break
            pd.decode_candidates = choice.candidates
            dcand = choice.chosen
            tried.append(dcand.name)
            metrics.pd_pull_tokens.inc(dcand.uncached)
            result = await self._decode(dcand.worker, dcand, exchange, half)
            if isinstance(result, int):
                return result
            pd.decode.append(PhaseAttempt(dcand.name, result.cause, 0.0))
            if result.final or not self._budget.try_spend(self._clock()):
                return result
            metrics.child(metrics.pd_retries, "decode", result.cause).inc()
        if isinstance(result, Failure) and result.cause != "no_decode":
            return result
        message = f"no decode worker can serve model `{route.name}` right now"
        error = RouterError(NO_WORKER, message, retry_after=self._retry_after_s)
        return Failure("no_decode", error, final=True)

    async def _prefill(
        self,
        worker: Worker,
        cand: Candidate,
        req: ClientRequest,
        prompt: Prompt,
        pd: PdRecord,
        out: Outgoing,
        deadline: float,
    ) -> dict[str, Any] | Failure:
        """The prefill half on `worker`: its kv_transfer_params, or why it failed."""
        metrics = self._metrics
        breaker = worker.breaker
        breaker.on_send(self._clock())
        ticket = LoadTicket(worker.load, cand.uncached)
        self._prompt_size.observe(cand.uncached)
        self._routing.expect(worker, prompt)
        headers = req.headers
        if worker.url_shared:
            headers = [*headers, ("x-data-parallel-rank", str(worker.spec.dp_rank))]
        started = time.perf_counter()
        outcome = "connect"
        verdict = False
        try:
            async with asyncio.timeout_at(deadline):
                url = worker.url + out.path
                resp = await self._upstream.send("POST", url, headers, prefill_body(out.body))
                try:
                    data = await resp.read()
                finally:
                    resp.release()
            outcome = str(resp.status)
            metrics.child(metrics.upstream, worker.name, f"{resp.status // 100}xx").inc()
            if resp.status != 200:
                verdict = True
                if resp.status >= 500:
                    breaker.record_failure(self._clock())
                else:
                    breaker.release()
                retry = resp.status == 429 or retryable_status(resp.status)
                cause = "429" if resp.status == 429 else f"{resp.status // 100}xx"
                answer = (resp.status, response_headers(resp), data)
                return Failure(cause, None, answer, final=not retry)
            breaker.record_success()
            verdict = True
            try:
                return handoff_params(data)
            except HandoffError as exc:
                outcome = "no_params"
                metrics.child(metrics.errors, "pd_handoff").inc()
                self._ratelog.warning("pd_handoff", "%s: %s", worker.name, exc)
                return Failure("no_params", RouterError(UPSTREAM, f"{worker.name}: {exc}"))
        except UpstreamPoolTimeout as exc:
            return self._failures.pool_wait(exc)
        except UpstreamError as exc:
            verdict = True
            # retried even when sent: a prefill gives the client nothing, and its kept
            # blocks are freed when vLLM's lease runs out
            failure = self._failures.upstream(worker, exc, final=False)
            outcome = failure.cause
            return failure
        except TimeoutError:
            outcome = "deadline"
            metrics.child(metrics.upstream, worker.name, "timeout").inc()
            return self._failures.past_deadline()
        finally:
            seconds = time.perf_counter() - started
            pd.prefill.append(PhaseAttempt(worker.name, outcome, seconds))
            metrics.child(metrics.pd_phase_seconds, "prefill").observe(seconds)
            ticket.finish()
            if not verdict:
                breaker.release()
            self._registry.request_finished(worker)
