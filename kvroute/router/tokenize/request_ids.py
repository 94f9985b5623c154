"""Token ids carried by the request itself, and their validation.

Three places, in the order the router looks at them:
- ids the engine itself will prefill, in every mode: a completions `prompt` given as ids (the
  first prompt of a batch), an embeddings `input` given as ids, and vLLM's decode-side reuse
  field `kv_transfer_params.prompt_token_ids` on chat / responses requests (vLLM feeds those to
  the engine instead of rendering the messages, unless `echo` is set or a message has non-text
  content);
- in mode "request" only, the kvroute extension field `prompt_token_ids` (top level of a chat,
  responses or embeddings body): the client states that these are the ids the engine will
  render. vLLM ignores the field, so a client that sends wrong ids only misroutes itself.

Validation: a non-empty list of ints (not bools, not floats), each in [0, vocab size) when the
size is known, at most the configured maximum length. A violation is the client's fault
(TokenizeError, 400).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from kvroute.router.tokenize.chat_request import NotExact
from kvroute.router.tokenize.content_parts import MEDIA_PART_TYPES, TEXT_CONTENT_PART_TYPES
from kvroute.router.tokenize.errors import TokenizeError

EXTENSION_FIELD = "prompt_token_ids"


class IdsValidator:
    """Checks client token ids for one model (in C, via msgspec: ~10 ns per id)."""

    def __init__(self, vocab_size: int | None, max_len: int) -> None:
        self.vocab_size = vocab_size
        self.max_len = max_len
        meta = msgspec.Meta(ge=0) if vocab_size is None else msgspec.Meta(ge=0, lt=vocab_size)
        self._type: Any = list[Annotated[int, meta]]

    def __call__(self, value: Any, param: str) -> list[int]:
        """`value` as a list of token ids, or TokenizeError naming `param`."""
        if not isinstance(value, list) or not value:
            raise TokenizeError(f"`{param}` must be a non-empty list of token ids", param=param)
        if len(value) > self.max_len:
            raise TokenizeError(
                f"`{param}` has {len(value)} token ids, more than the limit of {self.max_len}",
                param=param,
            )
        try:
            ids: list[int] = msgspec.convert(value, self._type)
        except msgspec.ValidationError as exc:
            # e.g. "Expected `int`, got `str` - at `$[3]`" or "Expected `int` < 1000 - at ..."
            raise TokenizeError(
                f"`{param}` must be token ids within the vocabulary: {exc}", param=param
            ) from exc
        return ids


def validate_ids(value: Any, *, param: str, vocab_size: int | None, max_len: int) -> list[int]:
    """One-off form of IdsValidator."""
    return IdsValidator(vocab_size, max_len)(value, param)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(x) is int for x in value[:1])


def _first_ids_prompt(value: Any, param: str) -> Any | None:
    """The ids of the first prompt if `value` is an ids prompt (or a batch of them)."""
    if isinstance(value, list):
        if not value:
            raise TokenizeError(f"You must pass at least one prompt in `{param}`", param=param)
        if isinstance(value[0], list):
            return value[0]
        if not isinstance(value[0], str):
            return value
    return None


def _has_non_text(messages: Any) -> bool:
    if not isinstance(messages, list):
        return False
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        for name in ("reasoning", "reasoning_content"):
            r = msg.get(name)
            if isinstance(r, dict) and r.get("type") == "prompt_embeds":
                return True
        content = msg.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict):
                ptype = part.get("type", "text")
                if (
                    any(k in part for k in MEDIA_PART_TYPES)
                    or not isinstance(ptype, str)
                    or ptype not in TEXT_CONTENT_PART_TYPES
                ):
                    return True
    return False


def engine_ids(endpoint: str, body: Mapping[str, Any]) -> tuple[Any, str] | None:
    """(raw ids, field name) when the engine will prefill ids the request carries."""
    if endpoint == "/v1/completions":
        if body.get("prompt_embeds") is not None:
            raise NotExact("prompt_embeds")
        ids = _first_ids_prompt(body.get("prompt"), "prompt")
        return None if ids is None else (ids, "prompt")
    if endpoint == "/v1/embeddings":
        ids = _first_ids_prompt(body.get("input"), "input")
        return None if ids is None else (ids, "input")
    if endpoint in ("/v1/chat/completions", "/v1/responses"):
        kv = body.get("kv_transfer_params")
        if not isinstance(kv, dict) or kv.get("prompt_token_ids") is None:
            return None
        if body.get("echo") or _has_non_text(body.get("messages")):
            return None
        return kv["prompt_token_ids"], "kv_transfer_params.prompt_token_ids"
    return None


def hinted_ids(endpoint: str, body: Mapping[str, Any]) -> tuple[Any, str] | None:
    """The extension field a client may send in mode "request"."""
    if endpoint in ("/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/completions"):
        value = body.get(EXTENSION_FIELD)
        if value is not None:
            return value, EXTENSION_FIELD
    return None
