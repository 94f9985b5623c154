"""Reading a request body with a bound: a body larger than the limit is refused (413) as soon
as its declared length or the bytes received so far exceed it, never held whole in memory."""

from __future__ import annotations

from starlette.requests import Request

from kvroute.router.edge.errors import TOO_LARGE, RouterError


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
