"""Sending a chat request to the engine as a completion of the router's token ids.

The router renders and tokenizes every chat prompt anyway (its cache keys are hashes of the
exact ids). A vLLM API server given the same request renders and tokenizes it again before
the engine can start: for a long conversation that is milliseconds of the time to first
token, on a process that serves every other request too. Given `/v1/completions` with
`prompt` = the ids instead, it skips both. The answer comes back in completion shape and is
turned into the chat shape the client asked for, so the client sees a chat answer.

Only plain chat requests are sent this way: every field must mean the same to both
endpoints (`_SAME_MEANING`), a max token count must be given (a completion's default is 16,
a chat's is the rest of the context), one choice, no tools, no structured output, no
logprobs. Anything else keeps the chat endpoint, where vLLM's chat-specific processing (tool
and reasoning parsers, logprob shapes) applies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

# Fields that a chat and a completion request share, with the same meaning in vLLM.
_SAME_MEANING = frozenset(
    {
        "model",
        "max_tokens",
        "max_completion_tokens",  # renamed to max_tokens
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "stream",
        "stream_options",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "ignore_eos",
        "min_tokens",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "cache_salt",
        "user",
        "priority",
        "n",  # only 1, checked below
        "messages",  # replaced by the ids
        "add_generation_prompt",  # consumed by the rendering that produced the ids
    }
)

# Chat fields the completion does not carry: replaced by the ids and max_tokens, or n (1).
_REPLACED = frozenset({"messages", "add_generation_prompt", "max_completion_tokens", "n"})
_UNSET = {"refusal": None, "annotations": None, "audio": None, "function_call": None,
          "reasoning": None}  # fmt: skip
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder()


def completion_body(body: dict[str, Any], ids: Sequence[int]) -> bytes | None:
    """The /v1/completions body that asks the engine for the same answer as the chat request
    `body` whose rendered prompt is `ids`; None when the request is not plain enough to be
    sent that way (see the module doc)."""
    if not ids or not _SAME_MEANING.issuperset(body):
        return None
    if body.get("n", 1) not in (1, None):
        return None
    limit = body.get("max_completion_tokens")
    if limit is None:
        limit = body.get("max_tokens")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        return None
    out = {k: v for k, v in body.items() if k not in _REPLACED}
    out["max_tokens"] = limit
    out["prompt"] = ids if isinstance(ids, list) else list(ids)
    return _encoder.encode(out)


def _is_completion(obj: Any) -> bool:
    """A completion answer or chunk (vLLM names the object, but a chunk serialized without
    its unset fields need not: its `choices` tell), not an error."""
    if not isinstance(obj, dict) or "error" in obj:
        return False
    kind = obj.get("object")
    return kind == "text_completion" or (kind is None and isinstance(obj.get("choices"), list))


def _chat_id(completion_id: Any) -> Any:
    if isinstance(completion_id, str) and completion_id.startswith("cmpl-"):
        return "chatcmpl-" + completion_id[5:]
    return completion_id


def chat_response(body: bytes) -> bytes:
    """A whole (non-streamed) completion answer in chat shape; a body that is not a
    completion (an error, say) is returned unchanged."""
    try:
        obj = _decoder.decode(body)
    except msgspec.DecodeError:
        return body
    if not _is_completion(obj):
        return body
    choices = []
    for c in obj.get("choices") or []:
        if not isinstance(c, dict):
            continue
        choices.append(
            {
                "index": c.get("index", 0),
                # the fields vLLM's chat answer has, unset as it leaves them for plain text
                "message": {"role": "assistant", "content": c.get("text", ""), **_UNSET},
                "logprobs": None,
                "finish_reason": c.get("finish_reason"),
                "stop_reason": c.get("stop_reason"),
            }
        )
    out = {
        "id": _chat_id(obj.get("id")),
        "object": "chat.completion",
        "created": obj.get("created"),
        "model": obj.get("model"),
        "choices": choices,
        "usage": obj.get("usage"),
    }
    for k in ("system_fingerprint", "service_tier"):
        if obj.get(k) is not None:
            out[k] = obj[k]
    return _encoder.encode(out)


class ChatStream:
    """Turns a completion's SSE events into chat-completion chunks, event by event.

    Feed whole events (what `SseFilter.feed` returns); the first content event is preceded
    by the role chunk a chat stream starts with. Events that are not completion chunks (an
    error event, `[DONE]`) pass unchanged."""

    __slots__ = ("_started",)

    def __init__(self) -> None:
        self._started = False

    def convert(self, events: bytes) -> bytes:
        if not events:
            return events
        out: list[bytes] = []
        for event in events.split(b"\n\n"):
            if not event:
                continue
            out.append(self._event(event))
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data:"):
            return event + b"\n\n"
        payload = event[5:].strip()
        if not payload.startswith(b"{"):
            return event + b"\n\n"
        try:
            obj = _decoder.decode(payload)
        except msgspec.DecodeError:
            return event + b"\n\n"
        if not _is_completion(obj):
            return event + b"\n\n"
        head = {"id": _chat_id(obj.get("id")), "object": "chat.completion.chunk"}
        for k in ("created", "model", "system_fingerprint"):
            if obj.get(k) is not None:
                head[k] = obj[k]
        parts: list[bytes] = []
        choices = obj.get("choices") or []
        if choices and not self._started:
            self._started = True
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
            parts.append(_sse({**head, "choices": [{**role, "logprobs": None,
                                                    "finish_reason": None}]}))  # fmt: skip
        chunk: dict[str, Any] = {**head, "choices": [_delta(c) for c in choices]}
        for k, v in obj.items():
            if k not in chunk and k not in ("choices", "object", "id"):
                chunk[k] = v  # usage, and anything an engine adds
        parts.append(_sse(chunk))
        return b"".join(parts)


def _delta(c: Any) -> dict[str, Any]:
    if not isinstance(c, dict):
        return {"index": 0, "delta": {}}
    text = c.get("text") or ""
    finish = c.get("finish_reason")
    out: dict[str, Any] = {
        "index": c.get("index", 0),
        "delta": {"content": text} if (text or finish is None) else {},
        "logprobs": None,
        "finish_reason": finish,
    }
    if finish is not None:
        out["stop_reason"] = c.get("stop_reason")
    return out


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"
