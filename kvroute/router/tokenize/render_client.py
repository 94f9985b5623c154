"""Exact ids from the engine itself: vLLM's render endpoints, with `/tokenize` as a fallback.

vLLM 0.33 answers `POST /v1/chat/completions/render` (and `/v1/responses/render`) with one
`GenerateRequest` object and `POST /v1/completions/render` with a list of them; the ids are in
`token_ids`. These routes exist only when the engine runs with `--enable-scale-out` (or is a
`vllm launch render` server); otherwise they answer 403 (or 404 on older versions). Then the
client falls back to `POST /tokenize`, which applies the same chat template but knows fewer
request fields: a chat request that uses `documents` or `reasoning_effort` gets no ids that way;
a Responses request is sent as the chat conversation vLLM renders for it.
Which workers lack the render routes is remembered (bounded) so they are not asked twice.

Every failure (no worker, timeout, connection error, non-200, malformed answer) gives None and a
reason label: the router then routes without cache evidence. The engine's 400 for a bad request
is not turned into an error here; the proxied request gets the engine's own answer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Protocol

import aiohttp
import msgspec

from kvroute.router.tokenize.chat_request import NotExact
from kvroute.router.tokenize.errors import TokenizeError
from kvroute.router.tokenize.responses_request import responses_chat_body

_RENDER_PATHS = {
    "/v1/chat/completions": "/v1/chat/completions/render",
    "/v1/completions": "/v1/completions/render",
    "/v1/responses": "/v1/responses/render",
}
# Body fields the render endpoint refuses or that only concern the response stream.
_DROP = frozenset({"stream", "stream_options", "use_beam_search"})
_TOKENIZE_CHAT_FIELDS = (
    "model",
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)
_NO_RENDER_STATUSES = frozenset({403, 404, 405, 501})
_REMEMBERED_WORKERS = 4096


class JsonPoster(Protocol):
    """POSTs a JSON body; returns (status, body bytes); raises on connect errors/timeouts."""

    async def post_json(self, url: str, payload: Any, timeout_s: float) -> tuple[int, bytes]: ...


class AiohttpPoster:
    """A JsonPoster with its own pooled aiohttp session (created on first use)."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def post_json(self, url: str, payload: Any, timeout_s: float) -> tuple[int, bytes]:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                json_serialize=lambda o: msgspec.json.encode(o).decode()
            )
        async with self._session.post(
            url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            return resp.status, await resp.read()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class _Rendered(msgspec.Struct):
    token_ids: list[int]


class _Tokenized(msgspec.Struct):
    tokens: list[int]


_one = msgspec.json.Decoder(_Rendered)
_many = msgspec.json.Decoder(list[_Rendered])
_tokens = msgspec.json.Decoder(_Tokenized)


class RenderResult(msgspec.Struct, frozen=True):
    ids: list[int] | None
    reason: str  # "ok" or why there are no ids


class RenderClient:
    """Gets a request's ids from a worker."""

    def __init__(self, poster: JsonPoster, timeout_s: float) -> None:
        self._poster = poster
        self._timeout = timeout_s
        self._no_render: OrderedDict[str, None] = OrderedDict()

    async def ids(self, endpoint: str, body: Mapping[str, Any], worker_url: str) -> RenderResult:
        base = worker_url.rstrip("/")
        render_path = _RENDER_PATHS.get(endpoint)
        if render_path is not None and base not in self._no_render:
            payload = {k: v for k, v in body.items() if k not in _DROP}
            status, raw, failure = await self._post(base + render_path, payload)
            if failure is not None:
                return RenderResult(None, failure)
            if status == 200:
                return self._decode(raw, many=endpoint == "/v1/completions")
            if status not in _NO_RENDER_STATUSES:
                return RenderResult(None, f"http_{status // 100}xx")
            self._remember_no_render(base)
        payload_or_reason = _tokenize_payload(endpoint, body)
        if isinstance(payload_or_reason, str):
            return RenderResult(None, payload_or_reason)
        status, raw, failure = await self._post(base + "/tokenize", payload_or_reason)
        if failure is not None:
            return RenderResult(None, failure)
        if status != 200:
            return RenderResult(None, f"http_{status // 100}xx")
        try:
            ids = _tokens.decode(raw).tokens
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
            return RenderResult(None, "bad_response")
        return RenderResult(ids, "ok")

    async def _post(self, url: str, payload: Any) -> tuple[int, bytes, str | None]:
        try:
            status, raw = await self._poster.post_json(url, payload, self._timeout)
        except TimeoutError:
            return 0, b"", "timeout"
        except Exception as exc:  # the transport's own errors (e.g. the router's UpstreamTimeout)
            return 0, b"", "timeout" if "Timeout" in type(exc).__name__ else "unreachable"
        return status, raw, None

    def _decode(self, raw: bytes, many: bool) -> RenderResult:
        try:
            if many:
                items = _many.decode(raw)
                if not items:
                    return RenderResult(None, "bad_response")
                ids = items[0].token_ids
            else:
                ids = _one.decode(raw).token_ids
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
            return RenderResult(None, "bad_response")
        if not ids:
            return RenderResult(None, "bad_response")
        return RenderResult(ids, "ok")

    def _remember_no_render(self, base: str) -> None:
        self._no_render[base] = None
        while len(self._no_render) > _REMEMBERED_WORKERS:
            self._no_render.popitem(last=False)


def _tokenize_payload(endpoint: str, body: Mapping[str, Any]) -> dict[str, Any] | str:
    """The `/tokenize` request equivalent to `body`, or the reason there is none."""
    if endpoint == "/v1/chat/completions":
        if body.get("documents") is not None or body.get("reasoning_effort") is not None:
            return "tokenize_fallback_unsupported"
        return {k: body[k] for k in _TOKENIZE_CHAT_FIELDS if k in body}
    if endpoint == "/v1/responses":
        # the chat conversation vLLM renders for it, with the Responses tokenizer settings
        try:
            chat = responses_chat_body(body)
        except (NotExact, TokenizeError):
            return "tokenize_fallback_unsupported"
        if "model" in body:
            chat["model"] = body["model"]
        return chat
    if endpoint in ("/v1/completions", "/v1/embeddings"):
        prompt = body.get("prompt" if endpoint == "/v1/completions" else "input")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return "tokenize_fallback_unsupported"
        payload: dict[str, Any] = {"prompt": prompt}
        if "model" in body:
            payload["model"] = body["model"]
        if "add_special_tokens" in body:
            payload["add_special_tokens"] = body["add_special_tokens"]
        return payload
    return "tokenize_fallback_unsupported"
