"""The router's HTTP/1.1 server protocol: uvicorn's httptools protocol, with each response's
head sent in one write with the first piece of its body.

uvicorn writes the status line and headers to the socket as soon as the app sends
`http.response.start`, then every body message in a write of its own: two writes (and two
wake-ups of the client) for the smallest answer. The ASGI spec asks servers not to send
anything before the first body message; this protocol holds the head until then and writes
both at once. For the proxy that is one socket write (and one wake-up of the client) less
per request; no answer goes out later than before, since the proxy sends its head only once
it has the first body piece. Everything else is uvicorn's (`kvroute serve` passes this class
as uvicorn's `http` protocol). It relies on two uvicorn internals, `_start_asgi_task` and
the cycle's `transport` / `on_response` attributes (uvicorn 0.54); tests/router/
test_http_server.py fails if they change.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle


class _HeadWithBody:
    """The transport as one response's cycle sees it: the first write after the response
    started (uvicorn's head) is held and goes out with the next write; if none comes, when
    the response completes or the connection is closed. Writes before the response started
    (100 Continue) and after the head went out pass straight through."""

    __slots__ = ("_cycle", "_head", "_sent", "_transport")

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle
        self._transport = cycle.transport
        self._head: bytes | None = None
        self._sent = False  # the head went out: plain pass-through from now on

    def write(self, data: bytes) -> None:
        if not self._sent:
            if self._head is None:
                if self._cycle.response_started:
                    self._head = data  # `http.response.start` writes only the head
                    return
            else:
                data, self._head, self._sent = self._head + data, None, True
        self._transport.write(data)

    def flush(self) -> None:
        if self._head is not None:
            data, self._head, self._sent = self._head, None, True
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()


def _hold_head(cycle: RequestResponseCycle) -> None:
    transport = _HeadWithBody(cycle)
    done = cycle.on_response

    def on_response() -> None:
        transport.flush()  # a response without body bytes (HEAD, empty body)
        done()

    cycle.transport = transport  # type: ignore[assignment]
    cycle.on_response = on_response


class HeadWithBodyProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol; each response's head goes out with its first body."""

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        _hold_head(cycle)
        super()._start_asgi_task(cycle, app)


# uvicorn's `http` option (a string works for every process of `kvroute serve --workers N`)
PROTOCOL = "router.http_server:HeadWithBodyProtocol"
