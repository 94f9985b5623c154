"""A minimal vLLM-shaped engine for proxy tests (a test double: the real simulated engine in
`sim/` is used by the integration tests; this one exists to script faults precisely).

It serves /health, /v1/models, /metrics, /tokenize, /detokenize, /v1/chat/completions and
/v1/completions (streaming and not, usage with cached_tokens as vLLM reports it), records
every request it receives, and can be told to fail, hang, slow down or break mid-stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class Received:
    path: str
    body: dict[str, Any]
    raw: bytes
    headers: dict[str, str]
    header_list: list[tuple[str, str]] = field(default_factory=list)  # every one, in order


@dataclass
class EngineScript:
    name: str
    models: list[dict[str, Any]] = field(default_factory=lambda: [{"id": "m", "object": "model"}])
    fail_status: int | None = None  # answer every generation request with this status
    fail_times: int = -1  # how many requests fail (-1 = all, while fail_status is set)
    hang: bool = False
    healthy: bool = True
    chunks: int = 3
    chunk_delay_s: float = 0.0
    break_after_chunks: int | None = None  # drop the connection after this many chunks
    cached_tokens: Callable[[list[int]], int] = lambda ids: 0
    received: list[Received] = field(default_factory=list)
    active: int = 0
    cancelled: int = 0
    completed: int = 0


def tokens_of(body: dict[str, Any]) -> list[int]:
    """The fake tokenizer: one token per UTF-8 byte of the prompt text."""
    if "messages" in body:
        text = "".join(f"<{m.get('role')}>{m.get('content') or ''}" for m in body["messages"]) + (
            "<assistant>" if body.get("add_generation_prompt", True) else ""
        )
        return list(text.encode())
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], int):
            return list(prompt)
        prompt = prompt[0] if prompt else ""
        if isinstance(prompt, list):
            return list(prompt)
    return list(str(prompt).encode())


def make_engine(script: EngineScript) -> Starlette:
    async def health(request: Request) -> Response:
        return Response(status_code=200 if script.healthy else 503)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": script.models})

    async def metrics(request: Request) -> Response:
        text = (
            f'vllm:num_requests_running{{engine="0",model_name="m"}} {script.active}\n'
            f'vllm:num_requests_waiting{{engine="0",model_name="m"}} 0\n'
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} 0.1\n'
        )
        return Response(text, media_type="text/plain")

    async def tokenize(request: Request) -> Response:
        body = await request.json()
        ids = tokens_of(body)
        return JSONResponse({"count": len(ids), "max_model_len": 8192, "tokens": ids})

    async def detokenize(request: Request) -> Response:
        body = await request.json()
        return JSONResponse({"prompt": bytes(body["tokens"]).decode(errors="replace")})

    async def generate(request: Request) -> Response:
        raw = await request.body()
        body = json.loads(raw)
        script.received.append(
            Received(request.url.path, body, raw, dict(request.headers), request.headers.items())
        )
        if script.fail_status is not None and script.fail_times != 0:
            script.fail_times -= 1
            return JSONResponse(
                {"error": {"message": "scripted failure", "type": "X", "code": 1}},
                script.fail_status,
            )
        if script.hang:
            await asyncio.sleep(3600)
        ids = tokens_of(body)
        cached = script.cached_tokens(ids)
        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": script.chunks,
            "total_tokens": len(ids) + script.chunks,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        chat = request.url.path.endswith("chat/completions")
        if not body.get("stream"):
            text = "x" * script.chunks
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}}
                if chat
                else {"index": 0, "text": text}
            )
            script.completed += 1
            return JSONResponse(
                {
                    "id": "r1",
                    "object": "chat.completion",
                    "model": body.get("model"),
                    "engine": script.name,
                    "choices": [choice],
                    "usage": usage,
                }
            )
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(stream(chat, include_usage, usage), media_type="text/event-stream")

    async def stream(
        chat: bool, include_usage: bool, usage: dict[str, Any]
    ) -> AsyncIterator[bytes]:
        script.active += 1
        finished = False
        try:
            for i in range(script.chunks):
                if script.break_after_chunks is not None and i >= script.break_after_chunks:
                    raise RuntimeError("scripted mid-stream failure")
                delta = {"content": "x"} if i else {"role": "assistant", "content": ""}
                choice = {"index": 0, "delta": delta} if chat else {"index": 0, "text": "x"}
                yield _sse({"id": "r1", "engine": script.name, "choices": [choice]})
                if script.chunk_delay_s:
                    await asyncio.sleep(script.chunk_delay_s)
            end = {"index": 0, "delta": {}, "finish_reason": "stop"}
            yield _sse({"id": "r1", "choices": [end if chat else {"index": 0, "text": ""}]})
            if include_usage:
                yield _sse({"id": "r1", "choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            script.active -= 1
            if finished:
                script.completed += 1
            else:
                script.cancelled += 1

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/metrics", metrics),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/v1/chat/completions", generate, methods=["POST"]),
            Route("/v1/completions", generate, methods=["POST"]),
        ]
    )


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@contextlib.asynccontextmanager
async def serve(app: Any, *, keep: list[Any] | None = None, **kw: Any) -> AsyncIterator[str]:
    """Run an ASGI app with uvicorn on an ephemeral loopback port; yields its base URL.

    `keep` receives the uvicorn.Server, so a test can stop it early (`should_exit = True`)."""
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=1,
        **kw,
    )
    server = uvicorn.Server(config)
    if keep is not None:
        keep.append(server)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("server did not start")
        await asyncio.sleep(0.005)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)


def dead_url() -> str:
    """A loopback URL where nothing listens (connect errors)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"
