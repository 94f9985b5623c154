"""The router's HTTP/1.1 server protocol: uvicorn's httptools protocol, with each response's
head sent in one write with the first piece of its body.

uvicorn writes the status line and headers to the socket as soon as the app sends
`http.response.start`, then every body message in a write of its own: two writes (and two
wake-ups of the client) for the smallest answer. The ASGI spec asks servers not to send
anything before the first body message; this protocol holds the head until then and writes
both at once. For the proxy that is one write less per request (a loopback write costs
the router tens of microseconds on a busy machine, see bench/router_overhead_bench.py);
no answer goes out later than before, since the proxy sends its head only once it has the
first body piece. Everything else is uvicorn's (`kvroute serve` passes this class as
uvicorn's `http` protocol).
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle


class _Capture:
    """Stands in for the transport while uvicorn formats one message: keeps the bytes."""

    __slots__ = ("closed", "parts")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def close(self) -> None:
        self.closed = True


def _hold_head(cycle: RequestResponseCycle) -> None:
    """Make `cycle.send` keep the response head until the first body message."""
    send = cycle.send
    transport = cycle.transport
    head: bytes | None = None

    async def captured(message: Any) -> _Capture:
        capture = _Capture()
        cycle.transport = capture  # type: ignore[assignment]
        try:
            await send(message)
        finally:
            cycle.transport = transport
        return capture

    async def send_holding_head(message: Any) -> None:
        nonlocal head
        if head is None:
            if message["type"] != "http.response.start" or cycle.response_started:
                await send(message)  # the usual case after the first body message
                return
            head = b"".join((await captured(message)).parts)
            return
        capture = await captured(message)
        data, head = head + b"".join(capture.parts), None
        if data and not cycle.disconnected:
            transport.write(data)
        if capture.closed:
            transport.close()

    cycle.send = send_holding_head  # type: ignore[method-assign]


class HeadWithBodyProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol; each response's head goes out with its first body."""

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        _hold_head(cycle)
        super()._start_asgi_task(cycle, app)


# uvicorn's `http` option (a string works for every process of `kvroute serve --workers N`)
PROTOCOL = "router.http_server:HeadWithBodyProtocol"
