"""Reading a request body with bounds: a body larger than the limit is refused (413) as soon
as its declared length or the bytes received so far exceed it, never held whole in memory;
`BodyReader` adds the process's budget of body bytes in flight and a read deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from starlette.requests import Request

from kvroute.router.edge.errors import BODY_BUDGET, BODY_TIMEOUT, TOO_LARGE, RouterError

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


async def read_bounded(request: Request, limit: int) -> bytes:
    """The whole body, or RouterError(413) once it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(limit: int) -> RouterError:
    return RouterError(TOO_LARGE, f"request body exceeds the limit of {limit} bytes")


class BodyBudget:
    """Body bytes held by this process across all requests, at most `limit` at once: each
    request holds what its body declared (or has sent so far) until it ends."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, n: int) -> bool:
        """Hold `n` more bytes if they fit under the limit; whether they were taken."""
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def give_back(self, n: int) -> None:
        self.held -= n


class BodyLease:
    """What one request holds of the budget; `release()` when the request is over."""

    __slots__ = ("_budget", "held")

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget
        self.held = 0

    def grow_to(self, n: int) -> bool:
        if n <= self.held:
            return True
        if not self._budget.take(n - self.held):
            return False
        self.held = n
        return True

    def release(self) -> None:
        self._budget.give_back(self.held)
        self.held = 0


class BodyReader:
    """Reads request bodies under three bounds: `max_body` bytes each (413), the process's
    `budget` of body bytes in flight (503 with Retry-After), and `read_s` seconds for the
    whole body (408), so slow or huge uploads cannot pile up memory or requests."""

    def __init__(self, max_body: int, budget: BodyBudget, read_s: float, retry_after: int) -> None:
        self.max_body = max_body
        self.budget = budget
        self._read_s = read_s
        self._retry_after = retry_after

    def lease(self) -> BodyLease:
        return BodyLease(self.budget)

    async def read(
        self, headers: Iterable[tuple[bytes, bytes]], receive: Receive, lease: BodyLease
    ) -> bytes:
        """The whole body; RouterError (413, 503, 408) or ClientGone (the client left)."""
        declared = 0
        for name, value in headers:
            if name.lower() == b"content-length":
                declared = int(value) if value.isdigit() else 0
        if declared > self.max_body:
            raise too_large(self.max_body)
        self._hold(lease, declared)
        try:
            async with asyncio.timeout(self._read_s):
                return await self._chunks(receive, lease)
        except TimeoutError:
            raise RouterError(
                BODY_TIMEOUT, f"request body not received within {self._read_s:g} s"
            ) from None

    async def _chunks(self, receive: Receive, lease: BodyLease) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise too_large(self.max_body)
            self._hold(lease, size)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _hold(self, lease: BodyLease, n: int) -> None:
        if not lease.grow_to(n):
            raise RouterError(
                BODY_BUDGET,
                "router busy: too many request body bytes in flight",
                retry_after=self._retry_after,
            )


class ClientGone(Exception):
    """The client disconnected."""
