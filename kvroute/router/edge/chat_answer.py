"""The assistant's text in a chat answer, as the client will send it back in its next turn.

The router relays every chat answer; its text, taken here, lets the tokenizer encode the
conversation *with* the answer while the user reads it (`Tokenizers.remember_answer`), instead
of on the next request's critical path. Only plain answers qualify: one choice, string
content, no tool calls (a client sends those back in shapes the router cannot predict).
"""

from __future__ import annotations

from typing import Any

import msgspec

_decoder = msgspec.json.Decoder()
# An answer longer than this is not taken (the next turn then encodes it itself).
MAX_ANSWER_BYTES = 1 << 20


def answer_of_response(body: bytes) -> str | None:
    """The text of a whole (not streamed) chat completion response, or None."""
    if len(body) > MAX_ANSWER_BYTES:
        return None
    try:
        obj = _decoder.decode(body)
    except msgspec.DecodeError:
        return None
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    return _plain_text(choices[0].get("message"))


def _plain_text(message: Any) -> str | None:
    if not isinstance(message, dict) or message.get("tool_calls"):
        return None
    content = message.get("content")
    return content if isinstance(content, str) and content else None


class AnswerTap:
    """Collects the SSE bytes of a chat stream as relayed (bounded by MAX_ANSWER_BYTES: past
    it, nothing is kept) and gives the answer's text at the end."""

    __slots__ = ("_parts", "_size")

    def __init__(self) -> None:
        self._parts: list[bytes] | None = []
        self._size = 0

    def feed(self, data: bytes) -> None:
        if self._parts is None or not data:
            return
        self._size += len(data)
        if self._size > MAX_ANSWER_BYTES:
            self._parts = None
            return
        self._parts.append(data)

    def answer(self) -> str | None:
        """The streamed answer's text: the content deltas of choice 0 joined, or None (no
        content, another choice, tool calls, an error event, or past the bound)."""
        if not self._parts:
            return None
        pieces: list[str] = []
        for event in b"".join(self._parts).split(b"\n\n"):
            event = event.strip()
            if not event.startswith(b"data:"):
                continue
            payload = event[5:].strip()
            if payload == b"[DONE]":
                break
            try:
                obj = _decoder.decode(payload)
            except msgspec.DecodeError:
                return None
            if not isinstance(obj, dict) or "error" in obj:
                return None
            for choice in obj.get("choices") or ():
                if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                    return None
                delta = choice.get("delta")
                if not isinstance(delta, dict) or delta.get("tool_calls"):
                    return None
                content = delta.get("content")
                if isinstance(content, str):
                    pieces.append(content)
        text = "".join(pieces)
        return text or None
