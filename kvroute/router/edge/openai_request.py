"""Reading and checking a client's OpenAI request at the edge.

The body is decoded once (msgspec), the few fields the router relies on are type-checked so
that obviously malformed requests get an OpenAI-style 400 here rather than a worker's 500, and
the headers to forward are filtered (hop-by-hop headers and the router's own x-kvroute-*
headers never pass; clients cannot steer the router through them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from kvroute.router.edge.errors import INVALID_FIELD, RouterError
from kvroute.router.edge.json_input import decode_object

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
EMBEDDINGS = "/v1/embeddings"
GENERATION_ENDPOINTS = (CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS)

INTERNAL_PREFIX = b"x-kvroute-"
_DROP = frozenset(
    {
        b"host",
        b"content-length",
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-authorization",
        b"proxy-authenticate",
        b"accept-encoding",  # the router reads usage from bodies; keep them uncompressed
        b"expect",
        b"x-data-parallel-rank",  # which engine rank serves a request is the router's choice
    }
)
_FORWARDED_PREFIX = b"x-forwarded-"


@dataclass(slots=True)
class ClientRequest:
    endpoint: str
    body: dict[str, Any]
    raw: bytes
    model: str | None
    stream: bool
    wants_usage: bool  # the client itself asked for stream usage
    cache_salt: str
    headers: list[tuple[str, str]]  # to forward upstream
    header_map: dict[str, str]  # lower-cased, for lookups (session header)


def forward_headers(
    raw_headers: Iterable[tuple[bytes, bytes]], trusted_peer: bool = False
) -> list[tuple[str, str]]:
    """The client's headers the engine may see: no hop-by-hop headers (the fixed set and any
    the client names in `Connection:`), no x-kvroute-* and no `x-data-parallel-rank` (the
    router sets that one itself), and X-Forwarded-* / Forwarded only from a `trusted_peer`."""
    headers = list(raw_headers)
    named = {
        token.strip().lower()
        for name, value in headers
        if name.lower() == b"connection"
        for token in value.split(b",")
    }
    out = []
    for name, value in headers:
        lname = name.lower()
        if lname in _DROP or lname in named or lname.startswith(INTERNAL_PREFIX):
            continue
        if not trusted_peer and (lname.startswith(_FORWARDED_PREFIX) or lname == b"forwarded"):
            continue
        out.append((lname.decode("latin-1"), value.decode("latin-1")))
    return out


def parse_request(
    endpoint: str,
    raw: bytes,
    raw_headers: Iterable[tuple[bytes, bytes]],
    trusted_peer: bool = False,
) -> ClientRequest:
    """Decode and check a request body; raises RouterError (400) with the offending param."""
    body = decode_object(raw)
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise _bad("model", "must be a non-empty string")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("stream", "must be a boolean")
    if endpoint == EMBEDDINGS and stream:
        raise _bad("stream", "is not supported for embeddings")
    opts = body.get("stream_options")
    wants_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise _bad("stream_options", "must be an object")
        inc = opts.get("include_usage", False)
        if inc is not None and not isinstance(inc, bool):
            raise _bad("stream_options.include_usage", "must be a boolean")
        wants_usage = bool(inc)
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise _bad("cache_salt", "must be a non-empty string")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user", "must be a string")
    _check_prompt(endpoint, body)
    headers = forward_headers(raw_headers, trusted_peer)
    return ClientRequest(
        endpoint=endpoint,
        body=body,
        raw=raw,
        model=model,
        stream=stream,
        wants_usage=wants_usage,
        cache_salt=salt or "",
        headers=headers,
        header_map=dict(headers),
    )


def _check_prompt(endpoint: str, body: dict[str, Any]) -> None:
    if endpoint == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "must be a non-empty array of message objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _bad(f"messages[{i}]", "must be an object with a string 'role'")
    elif endpoint == COMPLETIONS:
        if not _is_prompt(body.get("prompt")):
            raise _bad("prompt", "must be a string, an array of strings, or token ids")
    elif endpoint == RESPONSES:
        value = body.get("input")
        if not isinstance(value, str | list) or not value:
            raise _bad("input", "must be a non-empty string or array")
    elif endpoint == EMBEDDINGS:
        value = body.get("input")
        if value is None or (isinstance(value, str | list) and not value):
            raise _bad("input", "is required")
        if not isinstance(value, str | list):
            raise _bad("input", "must be a string or an array")


def _is_prompt(value: object) -> bool:
    """A completions prompt: text, texts, token ids, or lists of ids (element types checked
    by msgspec, in C, so a 32K-token prompt costs microseconds)."""
    if isinstance(value, str):
        return True
    if not isinstance(value, list) or not value:
        return False
    first = value[0]
    if isinstance(first, str):
        kind: Any = list[str]
    elif isinstance(first, list):
        kind = list[list[int]]
        if not all(value):
            return False
    else:
        kind = list[int]
    try:
        msgspec.convert(value, kind)
    except msgspec.ValidationError:
        return False
    return True


def _bad(param: str, what: str) -> RouterError:
    return RouterError(INVALID_FIELD, f"'{param}' {what}", param=param)


def skips_prefix_cache(req: ClientRequest, embeddings_use_cache: bool = False) -> bool:
    """Requests vLLM serves without reading the prefix cache: `prompt_logprobs` (it must
    compute every prompt position) and embeddings, unless the model's embeddings use the cache
    (vLLM enables prefix caching for a decoder embedder with last-token pooling, and its embed
    requests read it; with mean/CLS pooling or bidirectional attention it is off). They reuse
    nothing anywhere."""
    if req.endpoint == EMBEDDINGS:
        return not embeddings_use_cache
    return req.body.get("prompt_logprobs") is not None


_USAGE_ON = b',"stream_options":{"include_usage":true,"continuous_usage_stats":false}}'


def with_stream_usage(body: dict[str, Any], raw: bytes | None = None) -> bytes:
    """The body with stream usage on (continuous usage off, as the client had it).

    `raw`, the bytes `body` was decoded from: without `stream_options` in it, the option is
    spliced in before the object's closing brace instead of re-encoding the whole body (a
    long prompt costs microseconds to encode); the body is otherwise forwarded verbatim."""
    if raw is not None and "stream_options" not in body and body:
        end = raw.rstrip()
        if end.endswith(b"}"):
            return end[:-1] + _USAGE_ON
    opts = dict(body.get("stream_options") or {})
    opts["include_usage"] = True
    opts["continuous_usage_stats"] = False
    return msgspec.json.encode({**body, "stream_options": opts})
