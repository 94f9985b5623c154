"""Prefill/decode disaggregation in the simulated engine: a producer and a consumer engine on
loopback, the consumer pulling the producer's blocks (kvroute/sim/engine/kv_transfer.py).
The field shapes are checked against vLLM's own code in test_sim_pd_vllm.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.engine.kv_transfer import KvTransfer, TransferConfig
from kvroute.sim.server import SimEngineThread
from kvroute.sim.timing import DEFAULT_GPU
from tests.sim.sim_wire import Subscriber

SPEED = 50.0
BLOCK = 16
LINK = 20e9  # bytes/s: slow enough that a pull takes measurable time at SPEED
TURN1 = "Disaggregated serving splits prefill and decode onto different engines. " * 10
TURN2 = TURN1 + "The decode engine keeps what it pulled, so the next turn pulls less. " * 6


def _engine(role: str, lease_s: float = 30.0) -> SimEngineThread:
    cfg = EngineConfig(
        speed=SPEED,
        num_blocks=512,
        max_model_len=2048,
        kv_transfer=TransferConfig(role, link_bytes_per_s=LINK, lease_s=lease_s),
    )
    return SimEngineThread(cfg)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[SimEngineThread, SimEngineThread]]:
    with _engine("kv_producer") as producer, _engine("kv_consumer") as consumer:
        yield producer, consumer


def _prefill(url: str, prompt: str) -> dict[str, Any]:
    body = {
        "model": "kvroute-sim",
        "prompt": prompt,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    resp = httpx.post(url + "/v1/completions", json=body, timeout=20)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def _decode_stream(url: str, prompt: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    body = {
        "model": "kvroute-sim",
        "prompt": prompt,
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": params,
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=20) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    return [json.loads(line[6:]) for line in lines]


def _state(url: str) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(url + "/sim/state", timeout=5).json()["kv_transfer"]
    return out


def _prompt_len(url: str, prompt: str) -> int:
    body = {"model": "kvroute-sim", "prompt": prompt}
    return int(httpx.post(url + "/tokenize", json=body, timeout=5).json()["count"])


def test_producer_keeps_blocks_and_consumer_pulls_only_what_it_lacks(
    pair: tuple[SimEngineThread, SimEngineThread],
) -> None:
    producer, consumer = pair
    n1 = _prompt_len(producer.url, TURN1)
    first = _prefill(producer.url, TURN1)
    params = first["kv_transfer_params"]
    host, port = producer.url.removeprefix("http://").split(":")
    assert (params["remote_host"], params["remote_port"]) == (host, int(port))
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_num_tokens"] == n1
    assert params["remote_prefill_cached_tokens"] == 0  # a cold producer
    (blocks,) = params["remote_block_ids"]  # one list per KV cache group
    assert len(blocks) == -(-n1 // BLOCK) and len(set(blocks)) == len(blocks)
    assert first["choices"][0]["finish_reason"] == "length"
    assert _state(producer.url)["leases_held"] == 1

    assert consumer.events is not None
    with Subscriber(consumer.events) as sub:
        started = time.monotonic()
        chunks = _decode_stream(consumer.url, TURN1, params)
        took = time.monotonic() - started
        batches = [sub.decode(m) for m in sub.messages()]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text and chunks[-1]["usage"]["completion_tokens"] == 6
    # usage reports the producer's hit, as vLLM does for a remote prefill
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    state = _state(consumer.url)
    assert state["pulls"] == {"ok": 1} and state["blocks_pulled"] == len(blocks)
    expected_s = len(blocks) * BLOCK * DEFAULT_GPU.kv_bytes_per_token / LINK / SPEED
    assert state["pull_seconds"] == pytest.approx(expected_s)
    assert took >= expected_s
    # the consumer now holds the prompt's blocks and says so in its KV events
    stored = [e for b in batches for e in b.events if hasattr(e, "block_hashes")]
    assert sum(len(e.block_hashes) for e in stored) >= n1 // BLOCK
    # the pull freed the producer's blocks
    pstate = _state(producer.url)
    assert pstate["leases_held"] == 0 and pstate["leases_pulled"] == 1

    # the next turn: the producer reuses its cache, the consumer pulls only the new blocks
    n2 = _prompt_len(producer.url, TURN2)
    second = _prefill(producer.url, TURN2)["kv_transfer_params"]
    assert second["remote_prefill_cached_tokens"] == n1 // BLOCK * BLOCK
    chunks = _decode_stream(consumer.url, TURN2, second)
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == n1 // BLOCK * BLOCK
    state = _state(consumer.url)
    assert state["blocks_pulled"] - len(blocks) == -(-n2 // BLOCK) - n1 // BLOCK


def test_unpulled_blocks_are_freed_when_the_lease_ends_and_decode_recomputes() -> None:
    with _engine("kv_producer", lease_s=0.3) as producer, _engine("kv_consumer") as consumer:
        params = _prefill(producer.url, TURN1)["kv_transfer_params"]
        assert _state(producer.url)["leases_held"] == 1
        deadline = time.monotonic() + 5
        while _state(producer.url)["leases_held"] and time.monotonic() < deadline:
            time.sleep(0.1)
        pstate = _state(producer.url)
        assert pstate["leases_held"] == 0 and pstate["leases_expired"] == 1
        usage = httpx.get(producer.url + "/sim/state", timeout=5).json()["kv_cache_usage"]
        assert usage == 0.0
        # the consumer finds the blocks gone and computes the prompt itself
        chunks = _decode_stream(consumer.url, TURN1, params)
        assert chunks[-1]["usage"]["completion_tokens"] == 6
        assert _state(consumer.url)["pulls"] == {"gone": 1}


def test_invalid_params_are_computed_locally_and_bad_types_refused(
    pair: tuple[SimEngineThread, SimEngineThread],
) -> None:
    _, consumer = pair
    before = _state(consumer.url)["pulls"].get("invalid", 0)
    chunks = _decode_stream(consumer.url, "short prompt", {"do_remote_prefill": True})
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert _state(consumer.url)["pulls"]["invalid"] == before + 1
    bad = {"model": "kvroute-sim", "prompt": "x", "kv_transfer_params": [1]}
    resp = httpx.post(consumer.url + "/v1/completions", json=bad, timeout=5)
    assert resp.status_code == 400 and "kv_transfer_params" in resp.text
    unknown = {"remote_request_id": "nope", "remote_engine_id": "nope"}
    resp = httpx.post(consumer.url + "/sim/kv/pull", json=unknown, timeout=5)
    assert resp.status_code == 404


def test_lease_table_is_bounded() -> None:
    kv = KvTransfer(
        TransferConfig("kv_producer"),
        engine_id="e",
        block_size=BLOCK,
        kv_bytes_per_token=1.0,
        speed=1.0,
        max_leases=2,
    )
    assert kv.hold("a", [[1]], 16) and kv.hold("b", [[2]], 16)
    assert not kv.hold("c", [[3]], 16)  # full: the caller frees the blocks at once
    assert set(kv.leases) == {"a", "b"}
    assert kv.take("a", "other-engine") is None and kv.take("a", "e") is not None
    assert kv.hold("c", [[3]], 16)


def test_roles_decide_who_keeps_and_who_pulls() -> None:
    roles = ("kv_producer", "kv_consumer", "kv_both")
    producer, consumer, both = (TransferConfig(r) for r in roles)
    prefill, decode = {"do_remote_decode": True}, {"do_remote_prefill": True}
    assert producer.produces(prefill) and not producer.consumes(decode)
    assert consumer.consumes(decode) and not consumer.produces(prefill)
    assert both.produces(prefill) and both.consumes(decode)
    assert not both.produces(None) and not both.consumes({})
    with pytest.raises(ValueError, match="kv role"):
        TransferConfig("kv_sender")
