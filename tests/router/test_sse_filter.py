"""The SSE filter against a plain event-by-event reference, on random streams and
random chunkings (usage-only chunks, usage riding on choices, text mentioning usage)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.edge.sse import SseFilter, usage_from_json


def reference(stream: bytes, strip: bool) -> tuple[bytes, int | None]:
    """Split into events; drop a usage-only chunk when stripping; last usage's cached."""
    out, cached = [], None
    events = stream.split(b"\n\n")
    tail = events.pop()
    for raw in events:
        event = raw + b"\n\n"
        payload = event[5:].strip() if event.startswith(b"data:") else b""
        usage = usage_from_json(payload) if payload.startswith(b"{") else None
        if usage is not None:
            cached = usage.cached_tokens
            body = json.loads(payload)
            if strip and body.get("usage") is not None and not body.get("choices"):
                continue
        out.append(event)
    return b"".join(out) + tail, cached


def event(kind: int, n: int) -> bytes:
    usage = {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": n}}
    bodies = [
        {"choices": [{"index": 0, "delta": {"content": "x"}}]},
        {"choices": [{"index": 0, "delta": {"content": 'the "usage" of words'}}]},
        {"choices": [], "usage": usage},  # usage-only (what the router asks for)
        {"choices": [{"index": 0, "delta": {}}], "usage": usage},  # continuous usage
    ]
    if kind == 4:
        return b"data: [DONE]\n\n"
    return b"data: " + json.dumps(bodies[kind]).encode() + b"\n\n"


@settings(max_examples=200, deadline=None)
@given(
    kinds=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 99)), max_size=30),
    cuts=st.lists(st.integers(1, 200), min_size=1, max_size=40),
    strip=st.booleans(),
    tail=st.sampled_from([b"", b'data: {"partial', b": comment"]),
)
def test_matches_reference(
    kinds: list[tuple[int, int]], cuts: list[int], strip: bool, tail: bytes
) -> None:
    stream = b"".join(event(k, n) for k, n in kinds) + tail
    f = SseFilter(strip_usage_chunk=strip)
    out, i, c = [], 0, 0
    while i < len(stream):
        size = cuts[c % len(cuts)]
        out.append(f.feed(stream[i : i + size]))
        i += size
        c += 1
    out.append(f.flush())
    expected, cached = reference(stream, strip)
    assert b"".join(out) == expected
    assert (f.usage.cached_tokens if f.usage else None) == cached
