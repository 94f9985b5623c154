"""Unit tests of the small pure pieces: breaker, hash ring, metrics parsing, SSE, retry budget,
request checking."""

from __future__ import annotations

import collections
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.config import RetryConfig
from kvroute.router.edge.errors import RouterError
from kvroute.router.edge.openai_request import forward_headers, parse_request, with_stream_usage
from kvroute.router.edge.retry import Backoff, RetryBudget
from kvroute.router.edge.sse import SseFilter, usage_from_json
from kvroute.router.fleet.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from kvroute.router.fleet.load import LoadTicket, WorkerLoad, parse_engine_metrics
from kvroute.router.routing.hashring import HashRing

# -- breaker ---------------------------------------------------------------------------


def test_breaker_opens_probes_and_closes() -> None:
    changes: list[tuple[str, str]] = []
    b = CircuitBreaker(3, 10.0, 2, on_change=lambda o, n: changes.append((o, n)))
    for _ in range(2):
        b.record_failure(0.0)
    assert b.state == CLOSED and b.allows(0.0)
    b.record_success()  # a success resets the consecutive count
    for _ in range(3):
        b.record_failure(1.0)
    assert b.state == OPEN and not b.allows(5.0)
    assert b.allows(11.0)  # open_s elapsed: one probe may go
    b.on_send(11.0)
    assert b.state == HALF_OPEN and not b.allows(11.0)  # only one probe at a time
    b.record_success()
    assert b.state == HALF_OPEN and b.allows(11.0)
    b.on_send(11.0)
    b.record_success()
    assert b.state == CLOSED
    assert changes == [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED)]


def test_breaker_probe_failure_reopens_and_release_frees_probe() -> None:
    b = CircuitBreaker(1, 5.0, 1)
    b.record_failure(0.0)
    b.on_send(6.0)
    b.record_failure(6.0)
    assert b.state == OPEN and not b.allows(10.0) and b.allows(11.0)
    b.on_send(11.0)
    b.release()  # client went away: no verdict, slot free again
    assert b.state == HALF_OPEN and b.allows(11.0)


# -- consistent hashing with bounded load --------------------------------------------------


def test_ring_is_stable_and_moves_few_keys() -> None:
    ring = HashRing(64)
    for i in range(8):
        ring.add(f"w{i}")
    keys = [f"session-{i}" for i in range(2000)]
    before = {k: ring.lookup(k, lambda _: True, {}, 100.0) for k in keys}
    assert before == {k: ring.lookup(k, lambda _: True, {}, 100.0) for k in keys}
    counts = collections.Counter(before.values())
    assert len(counts) == 8 and min(counts.values()) > 2000 / 8 / 3  # roughly even
    ring.add("w8")
    after = {k: ring.lookup(k, lambda _: True, {}, 100.0) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "w8" for k in moved)  # only keys that now belong to w8 move
    assert len(moved) < 2000 * 0.25


def test_ring_bounded_load_and_eligibility() -> None:
    ring = HashRing(32)
    for name in ("a", "b", "c"):
        ring.add(name)
    home = ring.lookup("k", lambda _: True, {}, 1.25)
    assert home is not None
    # The home worker is far above the mean: the key goes elsewhere, deterministically.
    load = {home: 10}
    other = ring.lookup("k", lambda _: True, load, 1.25)
    assert other != home and other == ring.lookup("k", lambda _: True, load, 1.25)
    assert ring.lookup("k", lambda n: n == "c", {}, 1.25) == "c"
    assert ring.lookup("k", lambda _: False, {}, 1.25) is None
    ring.remove(home)
    assert home not in ring and ring.lookup("k", lambda _: True, {}, 1.25) != home


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 50), min_size=1),
    st.text(max_size=20),
)
def test_ring_respects_bound(load: dict[str, int], key: str) -> None:
    ring = HashRing(16)
    for name in "abcdef":
        ring.add(name)
    chosen = ring.lookup(key, lambda n: n in load, load, 1.25)
    assert chosen in load
    total = sum(load.values())
    cap = -(-1.25 * (total + 1) // len(load))
    assert load[chosen] + 1 <= cap


# -- load ----------------------------------------------------------------------------------

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:num_requests_running_total 99
"""


def test_parse_engine_metrics_per_rank() -> None:
    assert parse_engine_metrics(METRICS, 0) == (3.0, 2.0, 0.25)
    assert parse_engine_metrics(METRICS, 1) == (7.0, 0.0, 0.5)
    plain = "vllm:num_requests_running 4\nvllm:num_requests_waiting 1\n"
    assert parse_engine_metrics(plain, 0) == (4.0, 1.0, None)
    assert parse_engine_metrics("garbage\n", 0) is None
    assert parse_engine_metrics("vllm:num_requests_running{x} nan-ish\n", 0) is None


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_parse_engine_metrics_never_crashes(text: str) -> None:
    parse_engine_metrics(text, 0)
    parse_engine_metrics("vllm:num_requests_running" + text, 1)


def test_load_ticket_is_idempotent() -> None:
    load = WorkerLoad()
    t = LoadTicket(load, 100)
    assert (load.running, load.prefilling, load.queued_prefill_tokens) == (1, 1, 100)
    t.prefill_done()
    t.prefill_done()
    assert (load.running, load.prefilling, load.queued_prefill_tokens) == (1, 0, 0)
    t.finish()
    t.finish()
    assert (load.running, load.prefilling, load.queued_prefill_tokens) == (0, 0, 0)


# -- SSE -----------------------------------------------------------------------------------


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


USAGE = {
    "prompt_tokens": 40,
    "completion_tokens": 3,
    "prompt_tokens_details": {"cached_tokens": 32},
}
STREAM = (
    _event({"id": "1", "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    + _event({"id": "1", "choices": [{"index": 0, "delta": {"content": "hi"}}]})
    + _event({"id": "1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    + _event({"id": "1", "choices": [], "usage": USAGE})
    + b"data: [DONE]\n\n"
)


@pytest.mark.parametrize("strip", [True, False])
@pytest.mark.parametrize("piece", [1, 7, 64, 10_000])
def test_sse_filter_any_chunking(strip: bool, piece: int) -> None:
    f = SseFilter(strip_usage_chunk=strip)
    out = b"".join(f.feed(STREAM[i : i + piece]) for i in range(0, len(STREAM), piece))
    out += f.flush()
    expected = STREAM.replace(_event({"id": "1", "choices": [], "usage": USAGE}), b"")
    assert out == (expected if strip else STREAM)
    assert f.usage is not None and f.usage.cached_tokens == 32 and f.usage.prompt_tokens == 40


def test_sse_filter_keeps_usage_riding_on_choices_and_responses_api() -> None:
    f = SseFilter(strip_usage_chunk=True)
    ev = _event({"choices": [{"index": 0, "delta": {}}], "usage": USAGE})  # continuous usage
    assert f.feed(ev) == ev
    done = {
        "type": "response.completed",
        "response": {"usage": {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 4}}},
    }
    ev2 = b"event: response.completed\n" + _event(done)
    assert f.feed(ev2) == ev2
    assert f.usage is not None and (f.usage.prompt_tokens, f.usage.cached_tokens) == (9, 4)
    bad = b'data: {"usage": oops\n\n'
    assert f.feed(bad) == bad  # undecodable events pass through unchanged


def test_usage_from_json() -> None:
    body = json.dumps({"choices": [], "usage": USAGE}).encode()
    usage = usage_from_json(body)
    assert usage is not None and usage.cached_tokens == 32
    no_details = usage_from_json(json.dumps({"usage": {"prompt_tokens": 5}}).encode())
    assert no_details is not None and no_details.cached_tokens is None
    assert usage_from_json(b"not json") is None


# -- retry ---------------------------------------------------------------------------------


def test_retry_budget() -> None:
    b = RetryBudget(ratio=0.5, min_per_s=1.0, cap=2.0)
    assert b.try_spend(0.0) and b.try_spend(0.0)
    assert not b.try_spend(0.0)  # bucket empty
    b.on_request()
    b.on_request()
    assert b.try_spend(0.0)  # two requests bought one retry
    assert not b.try_spend(0.5)
    assert b.try_spend(1.6)  # time refills at min_per_s


def test_backoff_grows_and_is_capped() -> None:
    cfg = RetryConfig(backoff_initial_s=0.1, backoff_multiplier=2, backoff_max_s=0.3)
    backoff = Backoff(cfg)
    assert 0.08 <= backoff.delay(1) <= 0.12
    assert 0.16 <= backoff.delay(2) <= 0.24
    assert backoff.delay(5) <= 0.3 * 1.2


# -- request checking ------------------------------------------------------------------------


def test_forward_headers_strip_internal_and_hop_by_hop() -> None:
    raw = [
        (b"Host", b"x"),
        (b"Authorization", b"Bearer k"),
        (b"X-KVRoute-Worker", b"w1"),
        (b"x-kvroute-cache-key", b"abc"),
        (b"Connection", b"keep-alive"),
        (b"Content-Type", b"application/json"),
        (b"X-Session-Id", b"s1"),
    ]
    assert forward_headers(raw) == [
        ("authorization", "Bearer k"),
        ("content-type", "application/json"),
        ("x-session-id", "s1"),
    ]


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("/v1/chat/completions", b"{", None),
        ("/v1/chat/completions", b"[1]", None),
        ("/v1/chat/completions", b'{"model": 3, "messages": []}', "model"),
        ("/v1/chat/completions", b'{"model": "m"}', "messages"),
        ("/v1/chat/completions", b'{"model": "m", "messages": [1]}', "messages[0]"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "stream": "y"}', "stream"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user"}], "stream_options": {"include_usage": 1}}',
            "stream_options.include_usage",
        ),
        ("/v1/completions", b'{"model": "m", "prompt": [true]}', "prompt"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "cache_salt": 5}', "cache_salt"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "user": 5}', "user"),
        ("/v1/embeddings", b'{"model": "m"}', "input"),
        ("/v1/embeddings", b'{"model": "m", "input": "x", "stream": true}', "stream"),
        ("/v1/responses", b'{"model": "m", "input": 4}', "input"),
    ],
)
def test_bad_requests_are_400_with_param(endpoint: str, body: bytes, param: str | None) -> None:
    with pytest.raises(RouterError) as err:
        parse_request(endpoint, body, [])
    assert err.value.kind.status == 400
    assert err.value.param == param


def test_good_request_and_usage_injection() -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true}'
    req = parse_request("/v1/chat/completions", body, [(b"x-session-id", b"abc")])
    assert req.stream and not req.wants_usage and req.model == "m"
    assert req.header_map["x-session-id"] == "abc"
    for raw in (None, body, body + b" \n"):
        injected = json.loads(with_stream_usage(req.body, raw))
        want = {"include_usage": True, "continuous_usage_stats": False}
        assert injected["stream_options"] == want
        assert injected["messages"] == req.body["messages"]
    assert with_stream_usage(req.body, body).startswith(body[:-1])  # spliced, not re-encoded
    # options the client set are kept (the body is re-encoded then)
    opts = b'{"model": "m", "prompt": "x", "stream": true, "stream_options": {"x": 1}}'
    req = parse_request("/v1/completions", opts, [])
    assert json.loads(with_stream_usage(req.body, opts))["stream_options"] == {
        "x": 1,
        "include_usage": True,
        "continuous_usage_stats": False,
    }


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_parse_request_fuzz(raw: bytes) -> None:
    for endpoint in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        try:
            parse_request(endpoint, raw, [])
        except RouterError as exc:
            assert exc.kind.status == 400


# integers within 64 bits: wider ones are refused at the edge (tests/router/test_hostile_json.py)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.text(max_size=6), json_values, min_size=1, max_size=5),
    st.sampled_from([None, 1, 2]),
)
def test_usage_splice_equals_re_encoding(fields: dict[str, object], indent: int | None) -> None:
    body = {"model": "m", "prompt": "x", **{f"x_{k}": v for k, v in fields.items()}}
    raw = json.dumps(body, indent=indent).encode()
    req = parse_request("/v1/completions", raw, [])
    spliced = json.loads(with_stream_usage(req.body, raw))
    assert spliced == json.loads(with_stream_usage(req.body))
