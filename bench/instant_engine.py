"""An engine that answers instantly: the baseline for measuring what a proxy adds.

A bare asyncio + httptools HTTP/1.1 server (keep-alive) with vLLM's response shapes:
POST /v1/chat/completions and /v1/completions (JSON, or SSE with `--chunks` events when the
body says "stream": true, plus the usage chunk when it asks for include_usage), GET /health,
/v1/models and /metrics. No generation, no sleeping: every microsecond measured through it is
the client's or the proxy's.

    python -m bench.instant_engine --port 0      # prints "PORT <n>" once listening
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httptools
import uvloop

MODEL = "m"


def _usage_json(cached: int) -> bytes:
    return json.dumps(
        {
            "prompt_tokens": 64,
            "completion_tokens": 8,
            "total_tokens": 72,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
    ).encode()


def make_bodies(chunks: int) -> dict[str, bytes]:
    usage = _usage_json(48)
    chat = (
        b'{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m",'
        b'"choices":[{"index":0,"message":{"role":"assistant","content":"' + b"x" * 32 + b'"},'
        b'"finish_reason":"stop"}],"usage":' + usage + b"}"
    )
    events = [
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
        b'"choices":[{"index":0,"delta":{"content":"xxxx"}}]}\n\n'
        for _ in range(chunks)
    ]
    final = (
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
        b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    )
    usage_event = (
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
        b'"choices":[],"usage":' + usage + b"}\n\n"
    )
    return {
        "chat": chat,
        "stream": b"".join(events) + final,
        "usage": usage_event,
        "done": b"data: [DONE]\n\n",
        "models": json.dumps(
            {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "x"}]}
        ).encode(),
        "metrics": (
            b'vllm:num_requests_running{engine="0",model_name="m"} 0\n'
            b'vllm:num_requests_waiting{engine="0",model_name="m"} 0\n'
            b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.0\n'
        ),
        "tokenize": json.dumps(
            {"count": 4, "max_model_len": 8192, "tokens": [1, 2, 3, 4]}
        ).encode(),
    }


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Conn(asyncio.Protocol):
    def __init__(self, bodies: dict[str, bytes], pace_s: float = 0.0) -> None:
        self.bodies = bodies
        self.pace_s = pace_s
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # uvloop's transports are not asyncio.Transport subclasses

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        url, body = self.url, b"".join(self.body)
        self.url, self.body = b"", []
        assert self.transport is not None
        if self.pace_s > 0 and _is_stream(url, body):
            self._paced(body)
            return
        self.transport.write(self._respond(url, body))
        if not self.parser.should_keep_alive():
            self.transport.close()

    def _paced(self, body: bytes) -> None:
        """Stream one content event per `pace_s` (a decode step), the first at once, on a
        fixed schedule from the request's arrival (a late step does not delay the ones after
        it: a GPU's decode steps do not wait for this process's CPU). The end of the stream
        (the finish chunk, the usage chunk when asked for, `[DONE]`) follows the last content
        event one step later, written back to back as vLLM does: usage costs no decode step."""
        b = self.bodies
        events = [e + b"\n\n" for e in b["stream"].split(b"\n\n") if e]
        content, tail = events[:-1], [events[-1]]
        if b'"include_usage":true' in body or b'"include_usage": true' in body:
            tail.append(b["usage"])
        tail.append(b["done"])
        steps = [[_chunk(e)] for e in content] + [[_chunk(e) for e in tail]]
        steps[-1][-1] += b"0\r\n\r\n"
        steps[0][0] = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + steps[0][0]
        )
        loop = asyncio.get_running_loop()
        transport = self.transport
        start = loop.time()

        def send(i: int) -> None:
            if transport.is_closing():
                return
            for data in steps[i]:
                transport.write(data)
            if i + 1 < len(steps):
                loop.call_at(start + (i + 1) * self.pace_s, send, i + 1)

        send(0)

    def _respond(self, url: bytes, body: bytes) -> bytes:
        b = self.bodies
        if url.startswith(b"/v1/chat/completions") or url.startswith(b"/v1/completions"):
            if b'"stream":true' in body or b'"stream": true' in body:
                out = _chunk(b["stream"])
                if b'"include_usage":true' in body or b'"include_usage": true' in body:
                    out += _chunk(b["usage"])
                out += _chunk(b["done"]) + b"0\r\n\r\n"
                return (
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n" + out
                )
            return _full(b["chat"], b"application/json")
        if url == b"/health":
            return _full(b"", b"text/plain")
        if url == b"/v1/models":
            return _full(b["models"], b"application/json")
        if url == b"/metrics":
            return _full(b["metrics"], b"text/plain")
        if url == b"/tokenize":
            return _full(b["tokenize"], b"application/json")
        return b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"


def _is_stream(url: bytes, body: bytes) -> bool:
    generation = url.startswith(b"/v1/chat/completions") or url.startswith(b"/v1/completions")
    return generation and (b'"stream":true' in body or b'"stream": true' in body)


def _full(body: bytes, ctype: bytes) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: " + ctype + b"\r\ncontent-length: "
        + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip


async def serve(host: str, port: int, chunks: int, pace_s: float = 0.0) -> None:
    loop = asyncio.get_running_loop()
    bodies = make_bodies(chunks)
    server = await loop.create_server(lambda: _Conn(bodies, pace_s), host, port, backlog=4096)
    sock_port = server.sockets[0].getsockname()[1]
    print(f"PORT {sock_port}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--chunks", type=int, default=16, help="SSE content events per stream")
    p.add_argument("--pace-ms", type=float, default=0.0, help="gap between streamed events")
    args = p.parse_args(argv)
    uvloop.run(serve(args.host, args.port, args.chunks, args.pace_ms / 1000))
    return 0


@contextlib.contextmanager
def running_engine(chunks: int = 16, pace_ms: float = 0.0) -> Iterator[str]:
    """Start an instant engine in its own process (own session); yields its base URL."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.instant_engine",
            "--chunks",
            str(chunks),
            "--pace-ms",
            str(pace_ms),
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"instant engine did not start: {line!r}")
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
