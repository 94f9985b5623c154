"""What one try of a request on one worker is made of and ends in, shared by the proxy's
single-worker attempt (`kvroute.router.edge.proxy`) and the two-phase one of a
prefill/decode fleet (`kvroute.router.edge.pd_attempt`): the request as it goes to the
engine, a failure before anything reached the client, and the failures both kinds make alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvroute.router.edge.errors import DEADLINE, POOL_WAIT, UPSTREAM, UPSTREAM_TIMEOUT, RouterError
from kvroute.router.edge.openai_request import ClientRequest
from kvroute.router.edge.upstream import (
    UpstreamError,
    UpstreamPoolTimeout,
    UpstreamResponse,
    UpstreamTimeout,
)
from kvroute.router.fleet.workers import Worker
from kvroute.router.ops.decisions import DecisionRecord
from kvroute.router.ops.metrics import RouterMetrics
from kvroute.router.routing.pipeline import AnswerTarget, Prompt

Send = Callable[[dict[str, Any]], Any]

# Hop-by-hop and framing headers of an engine's answer that the router sets itself.
_RESPONSE_DROP = frozenset(
    {
        b"content-length",
        b"transfer-encoding",
        b"connection",
        b"keep-alive",
        b"server",
        b"date",
        b"trailer",
        b"upgrade",
    }
)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """What goes to the engine: the path and body, whether the router added stream usage the
    client did not ask for, whether a completion answer must be turned into a chat one
    (`chat_as_completion`), and the tokenizer and tenant that keep the answer's text for the
    conversation's next turn (`tokenizer.remember_answers`; None: not kept)."""

    path: str
    body: bytes
    inject_usage: bool
    as_chat: bool = False
    keep_answer_for: AnswerTarget | None = None


@dataclass(frozen=True, slots=True)
class Exchange:
    """One client request on its way, the same for every attempt: the parsed request, its
    prompt, its decision record, what goes to the engine, the client's ASGI `send`, and the
    loop time by which the first byte must have come."""

    req: ClientRequest
    prompt: Prompt
    record: DecisionRecord
    out: Outgoing
    send: Send
    deadline: float


@dataclass(slots=True)
class Failure:
    """An attempt that failed before anything reached the client."""

    cause: str  # metric label: connect, timeout, 429, 5xx
    error: RouterError | None  # what to answer if no retry follows...
    upstream: tuple[int, list[tuple[bytes, bytes]], bytes] | None = None  # ...or this
    final: bool = False  # no retry may follow (the engine may be running it, or time is up)


@dataclass(frozen=True, slots=True)
class DecodeHalf:
    """The decode half of a disaggregated request: its body (with the prefill's
    kv_transfer_params), and the prefill worker and prediction the answer's cached_tokens
    check (vLLM reports the prefill's hit there)."""

    body: bytes
    prefill: Worker
    predicted: int | None


def response_headers(resp: UpstreamResponse) -> list[tuple[bytes, bytes]]:
    """The engine's answer headers the client gets (framing ones dropped)."""
    return [(k, v) for k, v in resp.headers if k not in _RESPONSE_DROP]


class Failures:
    """The failures every kind of attempt makes alike (counted the same way)."""

    def __init__(
        self,
        metrics: RouterMetrics,
        clock: Callable[[], float],
        retry_after_s: int,
        deadline_s: float,
    ) -> None:
        self._metrics = metrics
        self._clock = clock
        self._retry_after_s = retry_after_s
        self._deadline_s = deadline_s

    def pool_wait(self, exc: UpstreamPoolTimeout) -> Failure:
        """The router's own connections are all busy: another worker would not help."""
        error = RouterError(POOL_WAIT, str(exc), retry_after=self._retry_after_s)
        return Failure("pool_wait", error, final=True)

    def upstream(self, worker: Worker, exc: UpstreamError, *, final: bool) -> Failure:
        """A connect error or timeout on `worker`: counted, and held against its breaker."""
        timed_out = isinstance(exc, UpstreamTimeout)
        cause = "timeout" if timed_out else "connect"
        self._metrics.child(self._metrics.upstream, worker.name, cause).inc()
        worker.breaker.record_failure(self._clock())
        kind = UPSTREAM_TIMEOUT if timed_out else UPSTREAM
        return Failure(cause, RouterError(kind, f"{worker.name}: {exc}"), final=final)

    def past_deadline(self) -> Failure:
        """The request's deadline passed before its first byte: final."""
        message = f"no answer within the request deadline of {self._deadline_s:g} s"
        return Failure("deadline", RouterError(DEADLINE, message), final=True)
