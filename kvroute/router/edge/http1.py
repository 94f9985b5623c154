"""A lean pooled HTTP/1.1 client for the proxy's upstream calls (asyncio protocol + httptools).

The proxy sends one POST per request to a known engine and passes the answer through, so it
needs little of a general client: no redirects, cookies, proxies or decompression; TLS for
https:// engines is the event loop's own (stdlib `ssl`). What it needs is cheap: this client
costs a fraction of aiohttp's CPU per request (see bench/http_client_bench.py), which is most
of what a proxy adds under load.

- Keep-alive connections are pooled per (host, port, TLS or not), newest first; at most
  `limit` are open (idle or busy) across all hosts; a caller over the limit waits for one to
  be released or closes an idle one of another host. Idle connections older than
  `keepalive_s`, or that the server closed, are not reused.
- Failures: `UpstreamConnectError` (could not connect, or the connection broke or sent a
  malformed answer) and `UpstreamTimeout` (connect took longer than `connect_s`, not counting
  stalls of this process's own event loop when `stalls` is given, or the server sent nothing
  for `read_idle_s` while an answer was awaited).
- Streaming with backpressure: a response buffers at most `_HIGH_WATER` bytes, then the
  socket stops being read until the caller takes them.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

from kvroute.router.fleet.loop_stall import LoopStalls, wait_own_time


class UpstreamError(Exception):
    """`sent`: the request had been written to the engine when this happened, so the engine
    may be running it (a generation must not be sent again)."""

    sent = False


class UpstreamConnectError(UpstreamError):
    pass


class UpstreamTimeout(UpstreamError):
    pass


class UpstreamPoolTimeout(UpstreamError):
    """No pooled connection came free within the pool-wait timeout (the router is busy)."""


_HIGH_WATER = 1 << 16  # bytes buffered per response before reading pauses
_SKIP_REQUEST_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})

Headers = Sequence[tuple[str, str]] | Mapping[str, str]
Key = tuple[str, int, bool]  # host, port, TLS
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class _Target:
    key: Key
    host_header: str
    path: str


def _target(url: str) -> _Target:
    parts = urlsplit(url)
    default_port = _DEFAULT_PORTS.get(parts.scheme)
    if default_port is None or not parts.hostname:
        raise UpstreamConnectError(f"unsupported upstream URL {url!r} (http(s)://host:port/...)")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    key = (parts.hostname, parts.port or default_port, parts.scheme == "https")
    return _Target(key, parts.netloc, path)


class UpstreamResponse:
    """An open upstream response; the body is read with `read()` or `next_chunk()`.

    `headers` are the response headers as (lower-cased name, value) bytes pairs, in order.
    """

    __slots__ = (
        "_buf",
        "_conn",
        "_done",
        "_error",
        "_framed",
        "_head",
        "_keep_alive",
        "_released",
        "_size",
        "_waiter",
        "headers",
        "status",
    )

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._head: asyncio.Future[None] = conn.loop.create_future()
        self._buf: list[bytes] = []
        self._size = 0
        self._done = False
        self._framed = False  # length or chunked: the end is known without a close
        self._keep_alive = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._released = False

    # -- caller side ------------------------------------------------------------------------

    async def read(self) -> bytes:
        """The whole (rest of the) body."""
        parts: list[bytes] = []
        while True:
            if self._buf:
                parts.append(self._take())  # keeps a long body flowing past the high water
            if self._error is not None:
                raise self._error
            if self._done:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            await self._wait()

    async def next_chunk(self) -> bytes:
        """The next piece of body as it arrives; b"" at the end."""
        while not self._buf:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            # `_wait()` inlined: one coroutine less per streamed event
            waiter = self._waiter = self._conn.loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        buf = self._buf
        if len(buf) == 1 and self._size <= _HIGH_WATER:
            self._size = 0
            return buf.pop()
        return self._take()

    @property
    def at_end(self) -> bool:
        """The whole body arrived cleanly and was taken: `next_chunk()` would return b""."""
        return self._done and not self._buf and self._error is None

    def release(self) -> None:
        """Return the connection to the pool (body fully read), else close it."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        conn.response = None
        if self._done and self._keep_alive and self._error is None and not self._buf:
            conn.pool.put_back(conn)
        else:
            conn.close()

    def abort(self) -> None:
        """Drop the connection (the engine sees a disconnect); a no-op once released."""
        if not self._released:
            self._released = True
            self._conn.response = None
            self._conn.close()

    # -- internals --------------------------------------------------------------------------

    async def _wait(self) -> None:
        waiter = self._waiter = self._conn.loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _take(self) -> bytes:
        buf = self._buf
        data = buf[0] if len(buf) == 1 else b"".join(buf)
        buf.clear()
        if self._size > _HIGH_WATER:
            self._conn.resume()
        self._size = 0
        return data

    def _feed(self, data: bytes) -> None:
        self._buf.append(data)
        self._size += len(data)
        if self._size > _HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if self._done:
            return
        self._error = error
        if not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # retrieved: a caller that went away must not warn
        self._wake()


class _Connection(asyncio.Protocol):
    """One keep-alive connection; `response` is the answer being received, if any."""

    def __init__(self, pool: Http1Pool, key: Key) -> None:
        self.pool = pool
        self.key = key
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.gone = False
        self.idle_since = 0.0
        self._paused = False
        self._last_data = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._last_data = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._broken(UpstreamConnectError(f"malformed upstream response: {exc}"))
        except httptools.HttpParserUpgrade:
            self._broken(UpstreamConnectError("upstream switched protocols"))

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        resp = self.response
        if resp is not None and not resp._done:
            if resp._head.done() and not resp._framed and resp._error is None:
                resp._done = True  # a body delimited by the close
                resp._wake()
            else:
                resp._fail(UpstreamConnectError(f"upstream closed the connection ({exc or 'EOF'})"))
        self._cancel_timer()
        self._gone()

    # -- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.response is None or self.response._head.done():
            raise UpstreamConnectError("an answer nobody asked for")  # closes the connection

    def on_header(self, name: bytes, value: bytes) -> None:
        resp = self.response
        assert resp is not None
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value):
            resp._framed = True
        resp.headers.append((name, value))

    def on_headers_complete(self) -> None:
        resp = self.response
        assert resp is not None
        resp.status = self.parser.get_status_code()
        resp._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        resp = self.response
        assert resp is not None
        resp._feed(body)

    def on_message_complete(self) -> None:
        resp = self.response
        assert resp is not None
        resp._keep_alive = self.parser.should_keep_alive()
        resp._done = True
        self._cancel_timer()
        if not resp._head.done():  # pragma: no cover - headers always complete first
            resp._head.set_result(None)
        resp._wake()

    # -- used by the pool and the response --------------------------------------------------

    def send(self, response: UpstreamResponse, data: bytes, idle_s: float) -> None:
        assert self.transport is not None
        self.response = response
        self._last_data = self.loop.time()
        self._timer = self.loop.call_later(idle_s, self._check_idle, idle_s)
        self.transport.write(data)

    def _check_idle(self, idle_s: float) -> None:
        self._timer = None
        resp = self.response
        if resp is None or resp._done:
            return
        silent = self.loop.time() - self._last_data
        if self._paused or silent < idle_s:  # our reader is behind, or data came meanwhile
            wait = idle_s if self._paused else idle_s - silent
            self._timer = self.loop.call_later(wait, self._check_idle, idle_s)
            return
        resp._fail(UpstreamTimeout(f"upstream sent nothing for {idle_s:g} s"))
        self.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _broken(self, error: UpstreamError) -> None:
        if self.response is not None:
            self.response._fail(error)
        self.close()

    def reusable(self, idle_after: float) -> bool:
        """Open, and idle since `idle_after` (loop time) or later."""
        transport = self.transport
        return (
            not self.gone
            and transport is not None
            and not transport.is_closing()
            and self.idle_since >= idle_after
        )

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.gone:
            self._paused = False
            self._last_data = self.loop.time()
            self.transport.resume_reading()

    def close(self) -> None:
        self._cancel_timer()
        if self.transport is not None:
            self.transport.close()
        self._gone()

    def _gone(self) -> None:
        if not self.gone:
            self.gone = True
            self.pool.forget(self)


class Http1Pool:
    """Pooled keep-alive HTTP/1.1 connections to any number of http:// and https:// hosts.

    `tls` verifies https:// hosts (default: the system's roots); `server_name`, if given, is
    the name checked in their certificates instead of the URL's host (engines addressed by IP).
    """

    def __init__(
        self,
        *,
        limit: int,
        connect_s: float,
        read_idle_s: float,
        keepalive_s: float = 60.0,
        stalls: LoopStalls | None = None,
        wait_s: float = 5.0,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
    ) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self.loop = asyncio.get_running_loop()
        self._limit = limit
        self._connect_s = connect_s
        self._read_idle_s = read_idle_s
        self._keepalive_s = keepalive_s
        self._wait_s = wait_s  # longest wait for a free connection slot
        self._stalls = stalls  # the connect timeout does not count this loop's own stalls
        self._tls = tls
        self._server_name = server_name
        self._idle: dict[Key, list[_Connection]] = {}
        self._open = 0  # connections counted against the limit (connecting, busy or idle)
        self._waiters: list[asyncio.Future[None]] = []
        self._targets: dict[str, _Target] = {}
        self._closed = False

    @property
    def open_connections(self) -> int:
        return self._open

    def idle_connections(self) -> int:
        return sum(len(v) for v in self._idle.values())

    async def request(
        self, method: str, url: str, headers: Headers, body: bytes | None
    ) -> UpstreamResponse:
        """Send a request; returns once the response status and headers are in."""
        target = self._targets.get(url)
        if target is None:
            target = _target(url)
            if len(self._targets) < 4096:  # a few URLs per worker: bounded all the same
                self._targets[url] = target
        data = _encode(method, target, headers, body or b"")
        conn = await self._acquire(target.key)
        resp = UpstreamResponse(conn)
        try:
            conn.send(resp, data, self._read_idle_s)
            await resp._head
        except UpstreamError as exc:
            exc.sent = True  # written (or being written): the engine may have it
            resp.abort()
            raise
        except BaseException:
            resp.abort()
            raise
        return resp

    # -- the pool -----------------------------------------------------------------------------

    async def _acquire(self, key: Key) -> _Connection:
        while True:
            if self._closed:
                raise UpstreamConnectError("the upstream client is closed")
            idle = self._idle.get(key)
            if idle:
                now = self.loop.time()
                while idle:
                    conn = idle.pop()
                    if conn.reusable(now - self._keepalive_s):
                        return conn
                    conn.close()
            if self._open < self._limit or self._close_one_idle():
                break
            waiter = self.loop.create_future()
            self._waiters.append(waiter)
            timer = self.loop.call_later(self._wait_s, _expire, waiter, self._wait_s)
            try:
                await waiter
            finally:
                timer.cancel()
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        return await self._connect(key)

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    async def _connect(self, key: Key) -> _Connection:
        self._open += 1
        conn: _Connection | None = None
        host, port, tls = key
        context = self._tls_context() if tls else None
        try:
            _, made = await wait_own_time(
                self.loop.create_connection(
                    lambda: _Connection(self, key),
                    host,
                    port,
                    ssl=context,
                    server_hostname=(self._server_name or host) if tls else None,
                ),
                self._connect_s,
                self._stalls,
            )
            conn = made
        except TimeoutError:
            self._release_slot()
            raise UpstreamTimeout(f"connect to {key[0]}:{key[1]} timed out") from None
        except OSError as exc:
            self._release_slot()
            raise UpstreamConnectError(f"connect to {key[0]}:{key[1]}: {exc}") from None
        except BaseException:
            if conn is None:
                self._release_slot()
            else:
                conn.close()
            raise
        return made

    def _close_one_idle(self) -> bool:
        """Close the oldest idle connection (of any host) to make room; False if none."""
        oldest: list[_Connection] | None = None
        for conns in self._idle.values():
            if conns and (oldest is None or conns[0].idle_since < oldest[0].idle_since):
                oldest = conns
        if oldest is None:
            return False
        oldest.pop(0).close()
        return True

    def put_back(self, conn: _Connection) -> None:
        if conn.gone or self._closed:
            conn.close()
            return
        conn.idle_since = self.loop.time()
        self._idle.setdefault(conn.key, []).append(conn)
        self._wake_one()

    def forget(self, conn: _Connection) -> None:
        """A connection closed: free its slot."""
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
        self._release_slot()

    def _release_slot(self) -> None:
        self._open -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.pop(0)
            if not waiter.done():
                waiter.set_result(None)
                return

    async def close(self) -> None:
        """Close every idle connection; busy ones close when their response is done."""
        self._closed = True
        for conns in list(self._idle.values()):
            for conn in list(conns):
                conn.close()
        self._idle.clear()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)


def _expire(waiter: asyncio.Future[None], wait_s: float) -> None:
    if not waiter.done():  # a slot handed over first wins
        waiter.set_exception(
            UpstreamPoolTimeout(f"no upstream connection free within {wait_s:g} s")
        )


def _encode(method: str, target: _Target, headers: Headers, body: bytes) -> bytes:
    items = headers.items() if isinstance(headers, Mapping) else headers
    parts = [method, " ", target.path, " HTTP/1.1\r\nhost: ", target.host_header, "\r\n"]
    for name, value in items:
        if name.lower() in _SKIP_REQUEST_HEADERS:
            continue
        parts += (name, ": ", value, "\r\n")
    parts += ("content-length: ", str(len(body)), "\r\n\r\n")
    return "".join(parts).encode("latin-1") + body
