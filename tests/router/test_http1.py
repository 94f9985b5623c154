"""The proxy's upstream HTTP/1.1 client against real loopback servers (raw asyncio sockets,
so each test controls the bytes on the wire exactly)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvloop

from kvroute.router.edge.http1 import _HIGH_WATER, Http1Pool, UpstreamConnectError, UpstreamTimeout

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def on_both_loops(
    fn: Callable[[], Coroutine[Any, Any, None]],
) -> Callable[[str], None]:
    """Run the async test on asyncio's loop and on uvloop (the router's)."""

    def test(loop: str) -> None:
        with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
            runner.run(fn())

    test.__name__ = fn.__name__
    test.__doc__ = fn.__doc__
    return pytest.mark.parametrize("loop", list(LOOPS))(test)


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(head, body) of one request with a content-length."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


@contextlib.asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A loopback server; yields (base URL, [connections accepted])."""
    accepted = [0]
    tasks: set[asyncio.Task[None]] = set()

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            tasks.discard(task)

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        srv.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def keep_alive_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        await read_request(reader)
        writer.write(OK)
        await writer.drain()


def pool(**kw: float) -> Http1Pool:
    args: dict[str, float] = {"limit": 8, "connect_s": 1.0, "read_idle_s": 5.0}
    args.update(kw)
    return Http1Pool(
        limit=int(args["limit"]), connect_s=args["connect_s"], read_idle_s=args["read_idle_s"]
    )


@on_both_loops
async def test_keep_alive_reuses_one_connection() -> None:
    async with server(keep_alive_ok) as (url, accepted):
        p = pool()
        for _ in range(5):
            resp = await p.request("POST", url + "/v1/x", [("a", "b")], b"{}")
            assert resp.status == 200
            assert (b"content-type", b"application/json") in resp.headers
            assert await resp.read() == b"{}"
            resp.release()
        assert accepted[0] == 1
        assert p.idle_connections() == 1 and p.open_connections == 1
        await p.close()


@on_both_loops
async def test_request_bytes_on_the_wire() -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(OK)
        await writer.drain()

    async with server(handler) as (url, _):
        p = pool()
        headers = [("x-one", "1"), ("Content-Length", "999"), ("host", "evil"), ("x-two", "2")]
        resp = await p.request("POST", url + "/v1/completions?a=1", headers, b"hello")
        await resp.read()
        resp.release()
        await p.close()
    head, body = seen[0]
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/completions?a=1 HTTP/1.1"
    assert lines[1] == b"host: " + url.removeprefix("http://").encode()
    assert b"x-one: 1" in lines and b"x-two: 2" in lines
    assert [ln for ln in lines if ln.lower().startswith(b"content-length")] == [
        b"content-length: 5"
    ]
    assert not any(ln.lower().startswith(b"host: evil") for ln in lines)
    assert body == b"hello"


@on_both_loops
async def test_chunked_stream_arrives_piece_by_piece() -> None:
    step = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for piece in (b"data: 1\n\n", b"data: 2\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await step.wait()
            step.clear()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()  # keep the connection open

    async with server(handler) as (url, _):
        p = pool()
        resp = await p.request("POST", url + "/s", [], b"{}")
        assert await resp.next_chunk() == b"data: 1\n\n"
        step.set()
        assert await resp.next_chunk() == b"data: 2\n\n"
        step.set()
        assert await resp.next_chunk() == b""
        resp.release()
        assert p.idle_connections() == 1
        await p.close()


@on_both_loops
async def test_body_delimited_by_close() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\npart one, part two")
        await writer.drain()

    async with server(handler) as (url, _):
        p = pool()
        resp = await p.request("POST", url + "/", [], b"")
        assert await resp.read() == b"part one, part two"
        resp.release()
        assert p.idle_connections() == 0 and p.open_connections == 0
        await p.close()


@on_both_loops
async def test_server_closing_idle_connection_is_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await writer.drain()
        # then close the kept-alive connection, as uvicorn does after its keep-alive timeout

    async with server(handler) as (url, accepted):
        p = pool()
        for _ in range(3):
            resp = await p.request("POST", url + "/", [], b"{}")
            assert await resp.read() == b"{}"
            resp.release()
            await asyncio.sleep(0.05)  # the server's FIN arrives
        assert accepted[0] == 3
        assert p.open_connections == 0
        await p.close()


@on_both_loops
async def test_connect_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens once closed
    p = pool()
    with pytest.raises(UpstreamConnectError):
        await p.request("POST", f"http://127.0.0.1:{port}/", [], b"")
    assert p.open_connections == 0
    await p.close()


@on_both_loops
async def test_silent_server_times_out_before_and_during_the_body() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(10)

    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        await asyncio.sleep(10)

    p = pool(read_idle_s=0.2)
    async with server(silent) as (url, _):
        with pytest.raises(UpstreamTimeout):
            await p.request("POST", url + "/", [], b"")
    async with server(stalls) as (url, _):
        resp = await p.request("POST", url + "/", [], b"")
        assert await resp.next_chunk() == b"abc"
        with pytest.raises(UpstreamTimeout):
            await resp.next_chunk()
        resp.abort()
    await asyncio.sleep(0)
    assert p.open_connections == 0
    await p.close()


@on_both_loops
async def test_broken_mid_body_and_malformed_answers() -> None:
    async def breaks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this")
        await writer.drain()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    p = pool()
    async with server(breaks) as (url, _):
        resp = await p.request("POST", url + "/", [], b"")
        with pytest.raises(UpstreamConnectError):
            await resp.read()
        resp.abort()
    async with server(garbage) as (url, _):
        with pytest.raises(UpstreamConnectError):
            await p.request("POST", url + "/", [], b"")
    await asyncio.sleep(0)
    assert p.open_connections == 0
    await p.close()


def _kernel_buffer_bytes() -> int:
    """The most a loopback connection's kernel buffers can hold (the TCP receive and send
    buffers' autotuning maxima), so a test can send more than that."""
    try:
        rmem = int(Path("/proc/sys/net/ipv4/tcp_rmem").read_text().split()[2])
        wmem = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, ValueError, IndexError):
        return 16 * 1024 * 1024
    return rmem + wmem


@on_both_loops
async def test_backpressure_bounds_what_is_buffered() -> None:
    sent = [0]
    big = b"x" * 65536
    # more than the kernel can buffer on both ends, so only backpressure can hold the server
    chunks = max(64, _kernel_buffer_bytes() // len(big) + 16)

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (chunks * len(big)))
        for _ in range(chunks):
            writer.write(big)
            await writer.drain()  # blocks once the client stops reading
            sent[0] += len(big)

    async with server(flood) as (url, _):
        p = pool()
        resp = await p.request("POST", url + "/", [], b"")
        await asyncio.sleep(0.3)  # the client reads nothing meanwhile
        assert resp._size <= _HIGH_WATER + len(big)
        assert sent[0] < chunks * len(big)  # the server is held back
        total = 0
        while chunk := await resp.next_chunk():
            total += len(chunk)
        assert total == chunks * len(big)
        resp.release()
        await p.close()


@on_both_loops
async def test_connection_limit_makes_callers_wait() -> None:
    gate = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            await gate.wait()
            writer.write(OK)
            await writer.drain()

    async with server(slow) as (url, accepted):
        p = pool(limit=1)

        async def call() -> bytes:
            resp = await p.request("POST", url + "/", [], b"{}")
            data = await resp.read()
            resp.release()
            return data

        tasks = [asyncio.create_task(call()) for _ in range(3)]
        await asyncio.sleep(0.1)
        assert p.open_connections == 1 and accepted[0] == 1
        gate.set()
        assert await asyncio.gather(*tasks) == [b"{}"] * 3
        assert accepted[0] == 1
        await p.close()


@on_both_loops
async def test_abort_drops_the_connection_and_cancel_frees_it() -> None:
    lost = asyncio.Event()

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
        await writer.drain()
        await reader.read()  # returns at EOF: the client dropped the connection
        lost.set()

    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()
        lost.set()

    p = pool()
    async with server(stream) as (url, _):
        resp = await p.request("POST", url + "/", [], b"")
        assert await resp.next_chunk() == b"a"
        resp.abort()
        await asyncio.wait_for(lost.wait(), 2)
    lost.clear()
    async with server(never) as (url, _):
        task = asyncio.create_task(p.request("POST", url + "/", [], b""))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(lost.wait(), 2)
    await asyncio.sleep(0)
    assert p.open_connections == 0
    await p.close()
