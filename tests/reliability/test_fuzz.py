"""Hypothesis fuzzing of the decoders of outside input that other tests do not fuzz already
(tests/bridge fuzzes the engine's ZMQ frames, tests/discovery the pod and file decoders,
tests/router the bare request parser):

- HTTP bodies of every OpenAI endpoint and of /admin/score through the whole router app (body
  checks, chat-template rendering and tokenization, scoring): never a 500;
- bytes arriving from a bridge into the router's event path, and valid-but-nonsense
  KvEventBatch / Snapshot messages into FleetIndex: never an exception, scores stay in range;
- router config files (YAML text and documents) and admin worker bodies: a config or a
  ConfigError, nothing else.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.loopback import ADMIN_TOKEN, MODEL
from kvroute.indexer import FleetIndex, Namespace
from kvroute.proto import events_pb2
from kvroute.router.app import create_app
from kvroute.router.config_load import ConfigError, config_from_dict, load_config, worker_from_dict
from kvroute.router.fleet.event_subscriptions import StreamStatus
from kvroute.sim.model import MODEL_DIR

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=15,
)
roles = st.sampled_from(["user", "system", "assistant", "tool", "developer", "x", ""])
text_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"])}).flatmap(
    lambda d: st.fixed_dictionaries(
        {**{k: st.just(v) for k, v in d.items()}, "text": st.text(max_size=40) | json_values}
    )
)
content = st.text(max_size=80) | st.none() | st.lists(text_part, max_size=3) | json_values
message = st.fixed_dictionaries(
    {"role": roles | json_values},
    optional={
        "content": content,
        "name": st.text(max_size=10) | json_values,
        "tool_calls": json_values,
        "tool_call_id": st.text(max_size=10),
    },
)
models = st.just(MODEL) | st.just(MODEL) | st.just(MODEL) | json_values
common = {
    "max_tokens": st.integers(-5, 10**9) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": json_values,
    "cache_salt": st.text(max_size=10) | json_values,
    "user": st.text(max_size=10) | json_values,
    "n": st.integers(-2, 5) | json_values,
}
chat_bodies = st.fixed_dictionaries(
    {"model": models, "messages": st.lists(message, max_size=4) | json_values},
    optional={**common, "tools": json_values, "add_generation_prompt": json_values,
              "continue_final_message": json_values, "chat_template_kwargs": json_values},
)  # fmt: skip
token_ids = st.lists(st.integers(-(2**40), 2**40), max_size=40)
completion_bodies = st.fixed_dictionaries(
    {
        "model": models,
        "prompt": st.text(max_size=80)
        | st.lists(st.text(max_size=20), max_size=3)
        | token_ids
        | st.lists(token_ids, max_size=3)
        | json_values,
    },
    optional=common,
)
input_bodies = st.fixed_dictionaries(
    {"model": models, "input": st.text(max_size=80) | token_ids | json_values},
    optional=common,
)
ENDPOINTS = {
    "/v1/chat/completions": chat_bodies,
    "/v1/completions": completion_bodies,
    "/v1/responses": input_bodies,
    "/v1/embeddings": input_bodies,
}


class _App:
    """The router app in process (a worker at a closed port), on its own event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        config = config_from_dict(
            {
                "workers": [{"name": "w0", "url": "http://127.0.0.1:9", "model": MODEL}],
                "models": {MODEL: {"tokenizer": str(MODEL_DIR)}},
                "admin": {"token": ADMIN_TOKEN},
                "health": {"interval_s": 3600},
                "load": {"metrics_interval_s": 0},
                "timeouts": {"health_s": 0.2, "connect_s": 0.2},
            }
        )
        self.app = create_app(config)
        self._lifespan = self.app.router.lifespan_context(self.app)
        self.loop.run_until_complete(self._lifespan.__aenter__())
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://router"
        )

    def post(self, path: str, raw: bytes, admin: bool = False) -> httpx.Response:
        headers = {"content-type": "application/json"}
        if admin:
            headers["authorization"] = f"Bearer {ADMIN_TOKEN}"
        return self.loop.run_until_complete(self.client.post(path, content=raw, headers=headers))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.run_until_complete(self._lifespan.__aexit__(None, None, None))
        self.loop.close()


@pytest.fixture(scope="module")
def app() -> Iterator[_App]:
    a = _App()
    yield a
    a.close()


def _check(resp: httpx.Response, what: Any) -> None:
    # 503: the only worker is down; 502/504 would be it failing. Never the router's own 500.
    assert resp.status_code < 500 or resp.status_code in (502, 503, 504), (resp.text, what)
    if resp.status_code >= 400:
        assert "error" in resp.json(), resp.text


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_openai_bodies_never_500(app: _App, path: str, data: st.DataObject) -> None:
    body = data.draw(ENDPOINTS[path])
    raw = json.dumps(body).encode()
    _check(app.post(path, raw), body)
    # the admin explanation runs the same body through tokenization and scoring
    _check(app.post("/admin/score?endpoint=" + path, raw, admin=True), body)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(raw=st.binary(max_size=200) | st.text(max_size=100).map(str.encode))
def test_raw_bytes_never_500(app: _App, raw: bytes) -> None:
    for path in (*ENDPOINTS, "/tokenize", "/detokenize"):
        _check(app.post(path, raw), raw)
    _check(app.post("/admin/score", raw, admin=True), raw)
    _check(app.post("/admin/workers", raw, admin=True), raw)


# -- from a bridge ------------------------------------------------------------------------------
hashes = st.sampled_from([bytes([i]) * 8 for i in range(6)] + [b"", b"\x00", b"\xff" * 33])
group_events = st.builds(
    events_pb2.KvGroupEvent,
    operation=st.sampled_from([0, 1, 2, 3, 9]),
    group_id=st.sampled_from([0, 1, 2, 2**32 - 1]),
    block_hashes=st.lists(hashes, max_size=4),
    parent_block_hash=hashes,
    token_ids=st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 20), max_size=40),
    block_size=st.sampled_from([0, 1, 4, 7, 16, 32, 2**32 - 1]),
    kind=st.sampled_from(["full_attention", "sliding_window", "mamba", "mla_attention", "", "?"]),
    sliding_window=st.sampled_from([0, 1, 16, 48, 2**32 - 1]),
    lora_name=st.sampled_from(["", "a"]),
    cache_namespace=st.sampled_from(["", "s"]),
    unmatchable=st.booleans(),
)
batches = st.builds(
    events_pb2.KvEventBatch,
    sequence=st.integers(0, 12) | st.integers(0, 2**64 - 1),
    events=st.lists(group_events, max_size=5),
)
snapshots = st.builds(
    events_pb2.Snapshot,
    sequence=st.integers(0, 2**64 - 1),
    has_sequence=st.booleans(),
    events=st.lists(group_events, max_size=6),
    stream_id=st.text(max_size=8),
    reason=st.text(max_size=8),
)
messages = st.one_of(
    batches.map(lambda b: events_pb2.SubscribeResponse(batch=b)),
    snapshots.map(lambda s: events_pb2.SubscribeResponse(snapshot=s)),
)


@settings(max_examples=150, deadline=None)
@given(
    stream=st.lists(st.tuples(st.sampled_from(["w0", "w1"]), messages), max_size=12),
    probes=st.lists(st.lists(st.integers(0, 20), max_size=70), min_size=1, max_size=3),
)
def test_nonsense_event_messages_never_crash_the_index(
    stream: list[tuple[str, events_pb2.SubscribeResponse]], probes: list[list[int]]
) -> None:
    index = FleetIndex(4, max_entries_per_worker=200, max_pending_per_worker=50)
    for worker, message in stream:
        if message.HasField("snapshot"):
            index.apply_snapshot(worker, message.snapshot)
        else:
            index.apply(worker, message.batch)
        for tokens in probes:
            for ns in (Namespace(), Namespace(lora_name="a", cache_salt="s")):
                for name, value in index.score(tokens, ns).items():
                    assert value is None or 0 <= value <= max(0, len(tokens) - 1), (name, value)
                index.explain(tokens, ns)
        for name in index.workers():
            index.stats(name)


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=300) | messages.map(lambda m: m.SerializeToString()))
def test_bytes_from_a_bridge_into_the_router_event_path(raw: bytes) -> None:
    """What `GrpcTransport` decodes and `EventSubscriptions` applies: undecodable bytes are a
    DecodeError (the transport turns it into a dropped stream), anything decodable is applied
    without an exception."""
    from kvroute.router.config import EventsConfig
    from kvroute.router.fleet.event_subscriptions import EventSubscriptions
    from kvroute.router.ops.metrics import RouterMetrics
    from kvroute.router.routing.fleet_index_view import FleetIndexView

    try:
        message = events_pb2.SubscribeResponse.FromString(raw)
    except DecodeError:
        return
    index = FleetIndexView(hash_unit=4, max_entries_per_worker=200, max_pending_per_worker=50)
    subs = EventSubscriptions(index, EventsConfig(), RouterMetrics())
    status = StreamStatus()
    asyncio.run(subs._handle("w0", status, message))  # the one place messages are applied
    kind = message.WhichOneof("message")
    if kind == "batch":
        assert status.batches == 1 and status.last_sequence == message.batch.sequence
    elif kind == "snapshot":
        assert status.snapshots == 1 and status.stream_id == message.snapshot.stream_id
    index.score([1, 2, 3, 4, 5, 6, 7, 8, 9])
    index.stats("w0")


# -- config files and admin bodies ----------------------------------------------------------------
SECTIONS = ["workers", "models", "policy", "limits", "timeouts", "retry", "breaker", "health",
            "load", "events", "verify", "admin", "discovery", "tokenizer", "port", "host",
            "processes", "log_level"]  # fmt: skip
worker_like = st.fixed_dictionaries(
    {},
    optional={
        k: json_values | st.text(max_size=20)
        for k in ("name", "url", "bridge", "zmq", "replay", "topic", "dp_rank", "model", "instance")
    },
)
documents = st.dictionaries(
    st.sampled_from(SECTIONS) | st.text(max_size=8),
    json_values
    | st.lists(worker_like, max_size=3)
    | st.dictionaries(st.text(max_size=12), json_values, max_size=4),
    max_size=5,
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(doc=documents | json_values, text=st.text(max_size=200))
def test_config_files_are_a_config_or_a_clear_error(tmp_path: Path, doc: Any, text: str) -> None:
    for content in (yaml.safe_dump(doc), text):
        path = tmp_path / "router.yaml"
        path.write_text(content)
        try:
            load_config(str(path), env={})
        except ConfigError as exc:
            assert str(exc)


@settings(max_examples=300, deadline=None)
@given(body=worker_like | json_values)
def test_admin_worker_bodies_are_a_worker_or_a_clear_error(body: Any) -> None:
    if not isinstance(body, dict):
        return  # the admin endpoint refuses non-objects before this (tested over HTTP above)
    try:
        worker_from_dict(body)
    except ConfigError as exc:
        assert str(exc)
