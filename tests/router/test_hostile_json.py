"""Hostile JSON bodies (deep nesting, huge integers, out-of-range numbers, invalid UTF-8,
huge strings) get a 400 with an OpenAI error body from every parser of client input, never a
500: generated shapes against the parsing functions, then each shape against a running router
over a real socket."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.edge.errors import RouterError
from kvroute.router.edge.json_input import decode_json, decode_object, has_long_digit_run
from kvroute.router.edge.openai_request import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    RESPONSES,
    parse_request,
)
from kvroute.router.tokenize.chat_request import _tool_calls
from tests.router.harness import rig


def _nested(depth: int, opener: bytes) -> bytes:
    closer = b"]" if opener == b"[" else b"}"
    inner = b"1" if opener == b"[" else b'{"a":1}'
    if opener == b"{":
        return b'{"a":' * depth + inner + closer * depth
    return opener * depth + inner + closer * depth


# The shapes the router must refuse with a 400 (each is a whole request body).
deep = st.builds(_nested, st.integers(65, 50_000), st.sampled_from([b"[", b"{"]))
deep_unclosed = st.integers(5_000, 50_000).map(lambda n: b"[" * n)
huge_int = st.integers(20, 20_000).map(lambda n: b'{"model":"m","prompt":' + b"9" * n + b"}")
huge_number = st.sampled_from(
    [b"1e999999", b"-1e999999", b"1" * 5000 + b".5e99999", b"9" * 400 + b"e400"]
).map(lambda n: b'{"model":"m","temperature":' + n + b"}")
bad_utf8 = st.tuples(
    st.binary(max_size=20), st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8"])
).map(lambda t: b'{"model":"m","prompt":"' + t[0].replace(b'"', b"") + t[1] + b'"}')
huge_string_unclosed = st.integers(1 << 20, 4 << 20).map(lambda n: b'{"prompt":"' + b"a" * n)
hostile = st.one_of(deep, deep_unclosed, huge_int, huge_number, bad_utf8, huge_string_unclosed)


@settings(max_examples=60, deadline=None)
@given(hostile)
def test_hostile_bodies_are_invalid_json(raw: bytes) -> None:
    with pytest.raises(RouterError) as caught:
        decode_json(raw)
    assert caught.value.kind.status == 400
    assert caught.value.kind.kind == "invalid_json"
    assert len(caught.value.message) < 300  # never echoes the body back


@settings(max_examples=60, deadline=None)
@given(hostile, st.sampled_from([CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS]))
def test_parse_request_answers_400_for_every_endpoint(raw: bytes, endpoint: str) -> None:
    with pytest.raises(RouterError) as caught:
        parse_request(endpoint, raw, [])
    assert caught.value.kind.status == 400


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_decode_or_400(raw: bytes) -> None:
    try:
        value = decode_object(raw)
    except RouterError as exc:
        assert exc.kind.status == 400
    else:
        assert isinstance(value, dict)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids),
    max_leaves=20,
)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=8), json_values))
def test_valid_objects_still_decode(obj: dict[str, Any]) -> None:
    assert decode_object(msgspec.json.encode(obj)) == obj


@settings(max_examples=30, deadline=None)
@given(
    st.one_of(
        st.builds(_nested, st.integers(5_000, 50_000), st.sampled_from([b"[", b"{"])),
        deep_unclosed,
        st.integers(5_000, 20_000).map(lambda n: b"9" * n),
    )
)
def test_tool_call_arguments_that_blow_up_json_loads_become_empty(args: bytes) -> None:
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": args.decode()}}]
    out = _tool_calls(calls)
    assert out is not None and out[0]["function"]["arguments"] == {}


# -- over a real socket -----------------------------------------------------------------------

SHAPES = {
    "nested_5000": b"[" * 5000,
    "nested_objects": _nested(5000, b"{"),
    "int_5000_digits": b'{"model":"m","prompt":' + b"9" * 5000 + b"}",
    "exp_1e999999": b'{"model":"m","prompt":"x","temperature":1e999999}',
    "int_30_digits_token_id": b'{"model":"m","prompt":[' + b"9" * 30 + b"]}",
    "nested_80_in_a_field": b'{"model":"m","prompt":"x","x":' + b"[" * 80 + b"]" * 80 + b"}",
    "invalid_utf8": b'{"model":"m","prompt":"\xff\xfe"}',
    "huge_string_unclosed": b'{"model":"m","prompt":"' + b"a" * (2 << 20),
}
PATHS = [CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS, "/tokenize", "/detokenize"]
ADMIN_PATHS = ["/admin/workers", "/admin/score"]


def test_every_parser_answers_400_over_a_socket() -> None:
    asyncio.run(_every_parser_answers_400())


async def _every_parser_answers_400() -> None:
    async with rig(1) as r:
        registry = r.parts.metrics.registry

        def errors() -> float:
            value = registry.get_sample_value("kvroute_errors_total", {"kind": "invalid_json"})
            return value or 0.0

        before = errors()
        sent = 0
        for path in PATHS + ADMIN_PATHS:
            headers = {"content-type": "application/json"}
            if path.startswith("/admin"):
                headers.update(r.admin_headers())
            for name, raw in SHAPES.items():
                resp = await r.client.post(path, content=raw, headers=headers)
                sent += 1
                assert resp.status_code == 400, (path, name, resp.text[:200])
                error = resp.json()["error"]
                assert error["type"] == "invalid_request_error"
                assert error["message"].startswith("request body is "), (path, name)
        assert errors() - before == sent
        # the engine saw none of it, and the router still serves
        assert r.engines["w0"].received == []
        ok = await r.client.post(COMPLETIONS, json={"model": "m", "prompt": "hi"})
        assert ok.status_code == 200


def test_invalid_json_is_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        async with rig(1) as r:
            for _ in range(20):
                resp = await r.client.post("/tokenize", content=b"[" * 5000)
                assert resp.status_code == 400

    asyncio.run(go())
    logged = [rec for rec in caplog.records if "not valid JSON" in rec.getMessage()]
    assert len(logged) == 1


def _reference_long_run(raw: bytes) -> bool:
    run = 0
    for b in raw:
        run = run + 1 if 0x30 <= b <= 0x39 else 0
        if run >= 19:
            return True
    return False


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.binary(max_size=6),
            st.sampled_from([b"0", b"9", b"5", b" ", b"-", b".", b"e", b"\xd9", b"\x39\x00"]),
            st.integers(0, 30).map(lambda n: b"7" * n),
        ),
        max_size=40,
    ).map(b"".join)
)
def test_the_digit_run_check_is_a_run_of_nineteen_ascii_digits(raw: bytes) -> None:
    assert has_long_digit_run(raw) is _reference_long_run(raw)


@settings(max_examples=200, deadline=None)
@given(st.integers(-(2**70), 2**70))
def test_a_bare_integer_body_decodes_or_is_refused(value: int) -> None:
    """A body that is one number is a value or a 400, never an exception of the check
    itself; the 19-digit integers just below -2**63 are refused too."""
    raw = str(value).encode()
    if -(2**63) <= value <= 2**64 - 1:
        assert decode_json(raw) == value
    else:
        with pytest.raises(RouterError) as caught:
            decode_json(raw)
        assert caught.value.kind.status == 400 and "64 bits" in caught.value.message


@pytest.mark.parametrize(
    "raw",
    [
        b"10000000000000000000",
        b"12345678901234567890.5",
        b'"' + b"0" * 25 + b'"',
        b'"' + b"[" * 80 + b'"',
    ],
)
def test_bare_scalars_with_long_digit_runs_or_brackets_are_values(raw: bytes) -> None:
    assert decode_json(raw) == msgspec.json.decode(raw)
    with pytest.raises(RouterError):
        decode_object(raw)  # not an object: a 400 for a request body
