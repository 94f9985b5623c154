"""OpenAI-style error bodies and the router's error kinds.

Every error the router itself produces goes through `error_response` (HTTP) or `sse_error`
(mid-stream), with a stable `kind` that is also the label of the errors metric.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from starlette.responses import Response

_encoder = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class ErrorKind:
    kind: str  # metric label
    status: int
    type: str  # OpenAI error type


INVALID_JSON = ErrorKind("invalid_json", 400, "invalid_request_error")
INVALID_FIELD = ErrorKind("invalid_field", 400, "invalid_request_error")
TOKENIZE = ErrorKind("tokenize", 400, "invalid_request_error")
UNKNOWN_MODEL = ErrorKind("unknown_model", 404, "invalid_request_error")
NOT_FOUND = ErrorKind("not_found", 404, "invalid_request_error")
TOO_LARGE = ErrorKind("body_too_large", 413, "invalid_request_error")
BODY_TIMEOUT = ErrorKind("body_timeout", 408, "invalid_request_error")
BODY_BUDGET = ErrorKind("body_budget", 503, "service_unavailable")
POOL_WAIT = ErrorKind("pool_wait", 503, "service_unavailable")
WRITE_STALL = ErrorKind("write_stall", 499, "invalid_request_error")  # counted, never sent
DEADLINE = ErrorKind("deadline", 504, "server_error")
UNAUTHORIZED = ErrorKind("unauthorized", 401, "authentication_error")
FORBIDDEN = ErrorKind("admin_disabled", 403, "permission_error")
READ_ONLY = ErrorKind("admin_read_only", 403, "permission_error")
NO_WORKER = ErrorKind("no_worker", 503, "service_unavailable")
OVERLOADED = ErrorKind("overloaded", 503, "service_unavailable")
UPSTREAM = ErrorKind("upstream", 502, "server_error")
UPSTREAM_TIMEOUT = ErrorKind("upstream_timeout", 504, "server_error")
MID_STREAM = ErrorKind("mid_stream", 502, "server_error")


class RouterError(Exception):
    """An error answered to the client with an OpenAI error body."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after


def error_body(
    message: str, type_: str, status: int, param: str | None = None, code: str | None = None
) -> bytes:
    return _encoder.encode(
        {"error": {"message": message, "type": type_, "param": param, "code": code or status}}
    )


def error_response(exc: RouterError) -> Response:
    headers = {}
    if exc.retry_after is not None:
        headers["retry-after"] = str(exc.retry_after)
    body = error_body(exc.message, exc.kind.type, exc.kind.status, exc.param, exc.code)
    return Response(body, exc.kind.status, headers=headers, media_type="application/json")


def sse_error(message: str, status: int = 502) -> bytes:
    """An SSE error event as vLLM sends one mid-stream, followed by the [DONE] terminator."""
    body = error_body(message, "server_error", status)
    return b"data: " + body + b"\n\ndata: [DONE]\n\n"
