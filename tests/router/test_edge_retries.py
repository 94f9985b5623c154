"""Retries after the request reached the engine: a generation is never sent twice (a timeout
or a broken connection after sending is answered, not retried; connect failures still are),
embeddings may be, and a per-request deadline bounds the whole chain of attempts. Counted on
real upstreams: fake engines over loopback, and a raw TCP engine that drops the connection
once it has read a request."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from tests.router.fake_engine import dead_url
from tests.router.harness import rig

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
GENERATION_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/embeddings",
)
_MODELS = b'{"object":"list","data":[{"id":"m","object":"model"}]}'


class DroppingEngine:
    """Answers probes like an engine; reads each POST whole, counts it, and closes the
    connection without answering (a crash after the request was sent)."""

    def __init__(self) -> None:
        self.posts = 0  # generation requests (the router's render calls are not counted)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                length = 0
                for line in lines[1:]:
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":", 1)[1])
                if length:
                    await reader.readexactly(length)
                if method == "POST":
                    self.posts += path in GENERATION_PATHS
                    return  # close without a byte of answer
                body = _MODELS if path == "/v1/models" else b""
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def dropping_engines(n: int) -> AsyncIterator[tuple[list[DroppingEngine], list[str]]]:
    engines = [DroppingEngine() for _ in range(n)]
    servers = [await asyncio.start_server(e.handle, "127.0.0.1", 0) for e in engines]
    try:
        yield engines, [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers]
    finally:
        for s in servers:
            s.close()


@contextlib.asynccontextmanager
async def dropping_rig(n: int) -> AsyncIterator[tuple[list[DroppingEngine], Any]]:
    """A router in front of `n` dropping engines, once it takes them as ready."""
    async with dropping_engines(n) as (engines, urls):
        workers = [{"name": f"d{i}", "url": url} for i, url in enumerate(urls)]
        async with rig(0, extra_workers=workers) as r:
            for _ in range(200):
                if sum(1 for w in r.parts.registry if w.takes_requests(time.monotonic())) >= n:
                    break
                await asyncio.sleep(0.02)
            yield engines, r


def test_broken_connection_after_send_is_not_retried_for_generation() -> None:
    async def go() -> None:
        async with dropping_rig(2) as (engines, r):
            for path, body in (
                ("/v1/chat/completions", CHAT),
                ("/v1/completions", {"model": "m", "prompt": "hi"}),
                ("/v1/responses", {"model": "m", "input": "hi"}),
            ):
                before = sum(e.posts for e in engines)
                resp = await r.client.post(path, json=body)
                assert resp.status_code == 502, (path, resp.text)
                assert sum(e.posts for e in engines) - before == 1, path

    asyncio.run(go())


def test_broken_connection_after_send_is_retried_for_embeddings() -> None:
    async def go() -> None:
        async with dropping_rig(2) as (engines, r):
            resp = await r.client.post("/v1/embeddings", json={"model": "m", "input": "x"})
            assert resp.status_code == 502
            assert sum(e.posts for e in engines) == 2  # one per worker

    asyncio.run(go())


def test_timeout_after_send_is_not_retried() -> None:
    async def go() -> None:
        async with rig(2, timeouts={"read_idle_s": 0.3}) as r:
            for s in r.engines.values():
                s.hang = True
            resp = await r.client.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == 504
            assert sum(len(s.received) for s in r.engines.values()) == 1

    asyncio.run(go())


def test_connect_failure_is_still_retried() -> None:
    async def go() -> None:
        dead = [{"name": "dead", "url": dead_url()}]
        async with rig(1, extra_workers=dead, health={"interval_s": 60}) as r:
            for _ in range(6):
                resp = await r.client.post("/v1/chat/completions", json=CHAT)
                assert resp.status_code == 200  # a refused connection moved to w0
            assert len(r.engines["w0"].received) == 6

    asyncio.run(go())


def test_request_deadline_bounds_the_attempt_chain() -> None:
    async def go() -> None:
        async with rig(2, edge={"request_deadline_s": 0.5}) as r:
            for s in r.engines.values():
                s.hang = True
            started = time.perf_counter()
            resp = await r.client.post("/v1/chat/completions", json=CHAT)
            elapsed = time.perf_counter() - started
            assert resp.status_code == 504
            assert "deadline" in resp.json()["error"]["message"]
            assert 0.45 <= elapsed < 2.0
            assert sum(len(s.received) for s in r.engines.values()) == 1

    asyncio.run(go())


def test_request_deadline_stops_retries_of_failing_workers() -> None:
    async def go() -> None:
        async with rig(
            3,
            edge={"request_deadline_s": 0.3},
            retry={"max_attempts": 10, "backoff_initial_s": 0.2, "backoff_max_s": 0.2},
            breaker={"failure_threshold": 100},
        ) as r:
            for s in r.engines.values():
                s.fail_status = 503
            started = time.perf_counter()
            resp = await r.client.post("/v1/chat/completions", json=CHAT)
            elapsed = time.perf_counter() - started
            assert resp.status_code in (503, 504)
            assert elapsed < 1.0
            assert sum(len(s.received) for s in r.engines.values()) <= 2

    asyncio.run(go())
