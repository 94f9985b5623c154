"""Every fault knob of POST /sim/faults, observed from outside (HTTP and ZMQ)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sim_wire import Subscriber, replay

from kvroute.bridge.vllm_schema import BatchDecoder, DecodedCleared, MalformedPayload, parse_live
from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.server import SimEngineThread

PROMPT = "faults are injected on demand by tests and operators " * 6


@pytest.fixture
def sim() -> Iterator[SimEngineThread]:
    with SimEngineThread(EngineConfig(speed=100, num_blocks=512, max_model_len=1024)) as s:
        yield s


@pytest.fixture
def client(sim: SimEngineThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sim.url, timeout=20) as c:
        yield c


@pytest.fixture
def sub(sim: SimEngineThread) -> Iterator[Subscriber]:
    """Subscribed to the engine's PUB socket before the test sends anything."""
    assert sim.events
    with Subscriber(sim.events) as s:
        yield s


def faults(c: httpx.Client, **settings: Any) -> dict[str, Any]:
    r = c.post("/sim/faults", json=settings)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def gen(c: httpx.Client, i: int = 0, **kw: Any) -> httpx.Response:
    body = {"prompt": f"{i} {PROMPT}", "max_tokens": 4, "ignore_eos": True, **kw}
    return c.post("/v1/completions", json=body)


def cached_tokens(c: httpx.Client, i: int) -> int:
    """The prefix-cache hit of a one-token request for prompt `i`."""
    cached: int = gen(c, i, max_tokens=1).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def test_fail_next_and_fail_rate(client: httpx.Client) -> None:
    faults(client, fail_next=2)
    for _ in range(2):
        r = gen(client)
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "InternalServerError"
        assert r.json()["error"]["code"] == 500
    assert gen(client).status_code == 200
    faults(client, fail_rate=1.0)
    assert gen(client).status_code == 500
    faults(client, fail_rate=0.0)
    assert gen(client).status_code == 200
    assert client.get("/sim/faults").json()["faults"]["failed"] == 3


def test_fail_mid_stream(sim: SimEngineThread, client: httpx.Client) -> None:
    faults(client, fail_next=1, fail_mode="stream")
    body = {"prompt": PROMPT, "max_tokens": 8, "stream": True, "ignore_eos": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert lines[-1]["error"]["code"] == 500
    deadline = time.monotonic() + 5
    while sim.engine.scheduler.has_work() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sim.engine.scheduler.has_work()  # the failed request was aborted


def test_slowdown_makes_steps_slower() -> None:
    config = EngineConfig(speed=4, num_blocks=512, max_model_len=1024)  # steps ~2 ms each
    with SimEngineThread(config) as sim, httpx.Client(base_url=sim.url, timeout=30) as c:
        t0 = time.monotonic()
        gen(c, 1, max_tokens=20)
        normal = time.monotonic() - t0
        faults(c, slowdown=8.0)
        t0 = time.monotonic()
        gen(c, 2, max_tokens=20)
        slow = time.monotonic() - t0
        faults(c, slowdown=1.0)
    assert slow > 3 * normal


def test_hang_freezes_the_api_until_released(client: httpx.Client) -> None:
    faults(client, hang=True)
    with pytest.raises(httpx.ReadTimeout):
        client.get("/health", timeout=0.5)
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(gen(client, 3).status_code))
    t.start()
    time.sleep(0.5)
    assert not result  # still waiting
    assert client.get("/sim/faults").json()["faults"]["hang"] is True  # admin stays up
    faults(client, hang=False)
    t.join(10)
    assert result == [200]
    assert client.get("/health").status_code == 200


def test_drop_batches_makes_a_gap_that_replay_fills(
    sim: SimEngineThread, client: httpx.Client, sub: Subscriber
) -> None:
    assert sim.replay
    gen(client, 1, max_tokens=1)
    faults(client, drop_batches=1)
    gen(client, 2, max_tokens=1)
    gen(client, 3, max_tokens=1)
    assert [m.seq for m in sub.messages()] == [0, 2]  # seq 1 was dropped: a gap
    replayed = replay(sim.replay, 1)
    assert replayed is not None and [s for s, _, _ in replayed] == [1, 2]


def test_drop_from_replay_makes_the_gap_unrecoverable(
    sim: SimEngineThread, client: httpx.Client, sub: Subscriber
) -> None:
    assert sim.replay
    gen(client, 1, max_tokens=1)
    faults(client, drop_batches=1, drop_from_replay=True)
    gen(client, 2, max_tokens=1)
    gen(client, 3, max_tokens=1)
    assert [m.seq for m in sub.messages()] == [0, 2]
    replayed = replay(sim.replay, 1)
    assert replayed is not None and [s for s, _, _ in replayed] == [2]  # starts later


def test_malformed_payload_and_frames(client: httpx.Client, sub: Subscriber) -> None:
    faults(client, malformed="payload")
    bad = sub.raw()
    assert bad is not None and len(bad) == 3
    msg = parse_live(bad)
    with pytest.raises(MalformedPayload):
        BatchDecoder().decode(msg.payload)
    faults(client, malformed="frames")
    frames = sub.raw()
    assert frames is not None and len(frames) == 2
    gen(client, 1, max_tokens=1)
    good = sub.messages()
    assert good and good[0].seq == msg.seq + 1  # the bad payload used a seq


def test_replay_can_be_disabled(sim: SimEngineThread, client: httpx.Client) -> None:
    assert sim.replay
    gen(client, 1, max_tokens=1)
    faults(client, replay=False)
    assert replay(sim.replay, 0, timeout=0.5) is None
    faults(client, replay=True)
    replayed = replay(sim.replay, 0)
    assert replayed is not None and replayed[0][0] == 0


def test_restart_empties_the_cache_and_restarts_the_sequence(
    client: httpx.Client, sub: Subscriber
) -> None:
    gen(client, 1, max_tokens=1)
    gen(client, 2, max_tokens=1)
    assert cached_tokens(client, 1) > 0
    before = [m.seq for m in sub.messages()]
    faults(client, restart=True)
    assert cached_tokens(client, 1) == 0
    after = [m.seq for m in sub.messages()]
    assert before[-1] >= 1 and after == [0]


def test_reset_prefix_cache_sends_all_blocks_cleared(client: httpx.Client, sub: Subscriber) -> None:
    gen(client, 1, max_tokens=1)
    assert faults(client, reset_prefix_cache=True)["reset_prefix_cache"] is True
    last = sub.decode(sub.messages()[-1]).events
    assert len(last) == 1 and isinstance(last[0], DecodedCleared)
    assert cached_tokens(client, 1) == 0
    assert client.post("/reset_prefix_cache").status_code == 200


def test_bad_fault_settings_are_rejected(client: httpx.Client) -> None:
    for body in ({"fail_rate": 2}, {"nope": 1}, {"fail_mode": "x"}, {"hang": "yes"}, [1]):
        r = client.post("/sim/faults", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == 400
