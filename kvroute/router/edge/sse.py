"""Server-sent events passing through the proxy: split into events, read usage, hide extras.

The proxy forwards upstream SSE bytes event by event (an event ends with a blank line). It
looks only at events that mention `"usage"`, to learn the engine's cached-token count, and,
when the router itself asked for usage the client did not want, drops the final usage-only
chunk so the client receives exactly what it would have without the router.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    prompt_tokens_details: _Details | None = None
    # /v1/responses names
    input_tokens: int | None = None
    input_tokens_details: _Details | None = None


class _Chunk(msgspec.Struct):
    usage: _Usage | None = None
    choices: list[msgspec.Raw] | None = None
    # /v1/responses: {"type": "response.completed", "response": {"usage": ...}}
    type: str | None = None
    response: _Chunk | None = None


_chunk_decoder = msgspec.json.Decoder(_Chunk)


@dataclass(frozen=True, slots=True)
class Usage:
    """What the engine said about the prompt."""

    prompt_tokens: int | None
    cached_tokens: int | None  # None when the engine does not report it


def usage_from_json(body: bytes) -> Usage | None:
    """Usage of a whole (non-streamed) JSON response; None if absent or not JSON."""
    try:
        chunk = _chunk_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
        return None
    return _usage_of(chunk)


def _usage_of(chunk: _Chunk) -> Usage | None:
    u = chunk.usage
    if u is None and chunk.response is not None:
        u = chunk.response.usage
    if u is None:
        return None
    details = u.prompt_tokens_details or u.input_tokens_details
    prompt = u.prompt_tokens if u.prompt_tokens is not None else u.input_tokens
    return Usage(prompt, details.cached_tokens if details is not None else None)


class SseFilter:
    """Feed upstream bytes; get back the bytes to send to the client.

    `strip_usage_chunk`: drop the usage-only chunk (empty `choices`, usage set) that the router
    requested on the client's behalf. `usage` holds the last usage seen.
    """

    __slots__ = ("_buf", "strip_usage_chunk", "usage")

    def __init__(self, strip_usage_chunk: bool) -> None:
        self._buf = b""
        self.strip_usage_chunk = strip_usage_chunk
        self.usage: Usage | None = None

    def feed(self, data: bytes) -> bytes:
        buf = self._buf + data if self._buf else data
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return b""
        complete, self._buf = buf[: end + 2], buf[end + 2 :]
        if b'"usage"' not in complete:
            return complete
        return self._scan(complete)

    def flush(self) -> bytes:
        """Whatever is left at end of stream (an unterminated last event), unchanged."""
        rest, self._buf = self._buf, b""
        return rest

    def _scan(self, complete: bytes) -> bytes:
        """Look only at the events that mention usage (a stream read in one piece holds
        many events, usually one with usage); drop the ones `_take_usage` says to."""
        out: list[bytes] = []
        kept = 0  # complete[kept:at] is passed on unchanged
        at = complete.find(b'"usage"')
        while at >= 0:
            start = complete.rfind(b"\n\n", kept, at)
            start = kept if start < 0 else start + 2
            end = complete.find(b"\n\n", at) + 2
            if self._take_usage(complete[start:end]):
                out.append(complete[kept:start])
                kept = end
            at = complete.find(b'"usage"', end)
        if not out:
            return complete
        out.append(complete[kept:])
        return b"".join(out)

    def _take_usage(self, event: bytes) -> bool:
        """Record usage from one event; True if the event must be dropped."""
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if not payload.startswith(b"{"):
                continue
            try:
                chunk = _chunk_decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
                return False
            usage = _usage_of(chunk)
            if usage is None:
                return False
            self.usage = usage
            return self.strip_usage_chunk and chunk.usage is not None and not chunk.choices
        return False
