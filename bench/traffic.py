"""Client side of the reliability tests and benchmarks: requests through a router, streams read
to the end and checked, the router's admin and metrics pages read.

A stream is *intact* when it has status 200, every event parses, it ends with `data: [DONE]`,
carries no error event, and its text equals what the engine produces for that prompt (the
simulated engine's output is a pure function of the prompt, so `expected_text` asks an engine
once, directly, without streaming).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.loopback import MODEL, admin_headers

DONE = b"data: [DONE]"
REFUSED = -1  # StreamResult.status when the connection was refused (request never accepted)


@dataclass(slots=True)
class StreamResult:
    status: int
    text: str = ""
    finish_reason: str | None = None
    done: bool = False  # saw data: [DONE]
    error: str | None = None  # an error event, or the client-side exception
    events: int = 0
    worker: str | None = None
    predicted: int | None = None
    cached_tokens: int | None = None
    retry_after: str | None = None
    body: bytes = b""

    def intact(self, expected: str | None) -> bool:
        return (
            self.status == 200
            and self.done
            and self.error is None
            and self.finish_reason is not None
            and (expected is None or self.text == expected)
        )


def completion_body(prompt: str, max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra}


def chat_body(content: str, max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **extra,
    }


async def stream(
    session: aiohttp.ClientSession,
    url: str,
    body: Mapping[str, Any],
    *,
    path: str = "/v1/completions",
    headers: Mapping[str, str] | None = None,
    stop_after_events: int | None = None,
    timeout: float = 60.0,
) -> StreamResult:
    """POST a streaming request and read it to the end (or close it after
    `stop_after_events` content events: a client that disconnects mid-stream)."""
    payload = {**body, "stream": True}
    chat = path.endswith("/chat/completions")
    try:
        async with session.post(
            url + path,
            json=payload,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            result = StreamResult(
                resp.status,
                worker=resp.headers.get("x-kvroute-worker"),
                predicted=_int(resp.headers.get("x-kvroute-predicted-cached-tokens")),
                retry_after=resp.headers.get("retry-after"),
            )
            if resp.status != 200:
                result.body = await resp.read()
                return result
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    _take_event(result, event, chat)
                    if stop_after_events is not None and result.events >= stop_after_events:
                        return result
            if buf.strip():
                result.error = result.error or f"truncated event at end: {buf[:80]!r}"
            return result
    except aiohttp.ClientConnectorError as exc:  # never accepted: nothing listens there
        return StreamResult(REFUSED, error=f"{type(exc).__name__}: {exc}")
    except (aiohttp.ClientError, TimeoutError) as exc:
        return StreamResult(0, error=f"{type(exc).__name__}: {exc}")


def _take_event(result: StreamResult, event: bytes, chat: bool) -> None:
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            if result.done:
                result.error = result.error or "two [DONE]"
            result.done = True
            continue
        if result.done:
            result.error = result.error or "data after [DONE]"
        try:
            obj = json.loads(data)
        except ValueError:
            result.error = result.error or f"unparsable event {data[:80]!r}"
            continue
        if "error" in obj:
            result.error = result.error or str(obj["error"].get("message"))
            continue
        usage = obj.get("usage")
        if usage:
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = details.get("cached_tokens")
        for choice in obj.get("choices") or []:
            result.events += 1
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            result.text += piece or ""
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]


def _int(value: str | None) -> int | None:
    return int(value) if value is not None and value.lstrip("-").isdigit() else None


async def expected_text(
    session: aiohttp.ClientSession,
    engine_url: str,
    body: Mapping[str, Any],
    path: str = "/v1/completions",
) -> str:
    """What the engine answers for `body` (asked directly, not streamed)."""
    payload = {**body, "stream": False}
    async with session.post(engine_url + path, json=payload) as resp:
        data = await resp.json()
        assert resp.status == 200, data
    choice = data["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


async def post_json(
    session: aiohttp.ClientSession,
    url: str,
    body: Any = None,
    headers: Mapping[str, str] | None = None,
    method: str = "POST",
) -> tuple[int, Any, Mapping[str, str]]:
    for attempt in (1, 2):
        try:
            async with session.request(method, url, json=body, headers=headers) as resp:
                raw = await resp.read()
                try:
                    data: Any = json.loads(raw) if raw else None
                except ValueError:
                    data = raw
                return resp.status, data, resp.headers
        except aiohttp.ServerDisconnectedError:
            if attempt == 2:
                raise
            # a pooled keep-alive connection to a process that was restarted meanwhile
    raise AssertionError("unreachable")


async def score(session: aiohttp.ClientSession, router: str, body: Any) -> dict[str, Any]:
    """The router's /admin/score answer for an OpenAI body."""
    status, data, _ = await post_json(session, router + "/admin/score", body, admin_headers())
    assert status == 200, data
    assert isinstance(data, dict)
    return data


def predictions(scored: Mapping[str, Any]) -> dict[str, int | None]:
    return {w["worker"]: w["predicted_reuse"] for w in scored["workers"]}


async def workers(session: aiohttp.ClientSession, router: str) -> dict[str, dict[str, Any]]:
    status, data, _ = await post_json(
        session, router + "/admin/workers", None, admin_headers(), "GET"
    )
    assert status == 200, data
    return {w["name"]: w for w in data["workers"]}


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """A Prometheus page as {'name{label="v",...}': value} (labels sorted by name)."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def metric(page: Mapping[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when none)."""
    total = 0.0
    for key, value in page.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


async def eventually(
    check: Callable[[], Awaitable[bool]], timeout: float = 15.0, interval: float = 0.05
) -> None:
    """Wait until `check()` is true; AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if await check():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(interval)


@dataclass
class Tally:
    """Outcome counts of a batch of streams."""

    sent: int = 0
    intact: int = 0
    lost: int = 0  # no answer at all, or a broken / truncated / wrong answer
    refused: int = 0  # an explicit error status (503, ...) the client can act on
    failures: list[str] = field(default_factory=list)

    def add(self, result: StreamResult, expected: str | None) -> None:
        self.sent += 1
        if result.intact(expected):
            self.intact += 1
        elif result.status not in (0, 200):
            self.refused += 1
        else:
            self.lost += 1
            if len(self.failures) < 5:
                self.failures.append(
                    f"status {result.status} done {result.done} error {result.error} "
                    f"text ok {result.text == expected}"
                )


def session(limit: int = 0) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, force_close=False))
