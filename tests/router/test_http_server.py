"""router.http_server: uvicorn's protocol with each response head written with its first body."""

from __future__ import annotations

import asyncio
from typing import Any

from router.http_server import PROTOCOL
from tests.router.fake_engine import serve

REQUEST = b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n"


def _app(release: asyncio.Event, fail: bool = False) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if fail:
            raise RuntimeError("boom before the response started")
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-a", b"1")]})
        await release.wait()
        await send({"type": "http.response.body", "body": b"one", "more_body": True})
        await send({"type": "http.response.body", "body": b"two", "more_body": False})

    return app


async def _read_until(reader: asyncio.StreamReader, end: bytes) -> bytes:
    data = b""
    while not data.endswith(end):
        chunk = await asyncio.wait_for(reader.read(65536), 5)
        assert chunk, f"connection closed after {data!r}"
        data += chunk
    return data


def test_head_waits_for_the_first_body_and_keep_alive_still_works() -> None:
    async def go() -> None:
        release = asyncio.Event()
        async with serve(_app(release), http=PROTOCOL) as url:
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            for _ in range(2):  # two requests on one keep-alive connection
                release.clear()
                writer.write(REQUEST)
                await writer.drain()
                try:
                    early = await asyncio.wait_for(reader.read(65536), 0.3)
                except TimeoutError:
                    early = b""
                assert early == b""  # the head is held while no body was sent
                release.set()
                first = await _read_until(reader, b"0\r\n\r\n")
                head, _, body = first.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200 OK") and b"x-a: 1" in head
                assert body == b"3\r\none\r\n3\r\ntwo\r\n0\r\n\r\n"
            writer.close()

    asyncio.run(go())


def test_an_app_failing_before_its_response_still_gets_a_500() -> None:
    async def go() -> None:
        async with serve(_app(asyncio.Event(), fail=True), http=PROTOCOL) as url:
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(REQUEST)
            await writer.drain()
            data = await _read_until(reader, b"Internal Server Error")
            assert data.startswith(b"HTTP/1.1 500 ")
            writer.close()

    asyncio.run(go())


def test_a_head_request_and_an_empty_body_are_answered() -> None:
    """Responses that write no body bytes still get their head (when they complete)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        headers = [(b"content-length", b"0")] if scope["path"] == "/empty" else []
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def go() -> None:
        async with serve(app, http=PROTOCOL) as url:
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"HEAD /x HTTP/1.1\r\nhost: t\r\n\r\n")
            data = await _read_until(reader, b"\r\n\r\n")
            assert data.startswith(b"HTTP/1.1 200 OK")
            writer.write(b"GET /empty HTTP/1.1\r\nhost: t\r\n\r\n")
            data = await _read_until(reader, b"\r\n\r\n")
            assert data.startswith(b"HTTP/1.1 200 OK") and b"content-length: 0" in data
            writer.close()

    asyncio.run(go())
