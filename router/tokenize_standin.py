"""Stand-in for `router.tokenize` (built on branch `tokenize`) until it is merged.

Same names and call shape as /work/notes/router-tokenize-api.md, minimal behaviour:
"request" takes ids from the request; "render" asks the worker's /tokenize endpoint (vLLM's,
which applies the chat template); a local model directory is not supported here (None).
No prefix cache, no executor: nothing CPU-heavy runs on the loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from router.upstream import Upstream, UpstreamError

_CHAT_KEYS = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "documents",
)


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    mode: Literal["local", "render", "request"]
    path: str | None = None
    chat_template: str | None = None


@dataclass(frozen=True, slots=True)
class TokenizedPrompt:
    token_ids: list[int]
    source: str


class TokenizeError(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _Tokens(msgspec.Struct):
    tokens: list[int]


_tokens_decoder = msgspec.json.Decoder(_Tokens)


def _int_list(value: object) -> list[int] | None:
    if (
        isinstance(value, list)
        and value
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    ):
        return list(value)
    return None


class Tokenizers:
    def __init__(
        self,
        specs: Mapping[str, TokenizerSpec],
        *,
        default: TokenizerSpec | None = None,
        render_timeout_s: float = 5.0,
        http: Upstream | None = None,
        **_: Any,
    ) -> None:
        self._specs = dict(specs)
        self._default = default
        self._timeout = render_timeout_s
        self._http = http

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def token_ids(
        self, model: str, endpoint: str, body: dict[str, Any], worker_url_for_render: str | None
    ) -> TokenizedPrompt | None:
        spec = self._specs.get(model, self._default)
        if spec is None:
            return None
        if spec.mode == "request":
            return self._from_request(endpoint, body)
        if spec.mode == "render":
            return await self._render(endpoint, body, worker_url_for_render)
        return None

    def _from_request(self, endpoint: str, body: dict[str, Any]) -> TokenizedPrompt | None:
        if endpoint == "/v1/completions":
            prompt = body.get("prompt")
            ids = _int_list(prompt)
            if ids is None and isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
                ids = _int_list(prompt[0])
        else:
            ids = _int_list(body.get("prompt_token_ids"))
        return TokenizedPrompt(ids, "request") if ids is not None else None

    async def _render(
        self, endpoint: str, body: dict[str, Any], url: str | None
    ) -> TokenizedPrompt | None:
        if url is None or self._http is None:
            return None
        payload: dict[str, Any] = {"model": body.get("model")}
        if endpoint == "/v1/chat/completions":
            for key in _CHAT_KEYS:
                if key in body:
                    payload[key] = body[key]
            payload.setdefault("add_generation_prompt", True)
        elif endpoint == "/v1/completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list):
                if not prompt:
                    return None
                prompt = prompt[0]
            if isinstance(prompt, list):
                ids = _int_list(prompt)
                return TokenizedPrompt(ids, "request") if ids is not None else None
            if not isinstance(prompt, str):
                return None
            payload["prompt"] = prompt
        else:
            return None
        try:
            status, raw = await self._http.post_json(url + "/tokenize", payload, self._timeout)
        except UpstreamError:
            return None
        if status != 200:
            return None
        try:
            return TokenizedPrompt(_tokens_decoder.decode(raw).tokens, "render")
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
