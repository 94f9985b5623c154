"""What the peer routers' P/D modes send, against a simulated producer and consumer engine.

The request shapes are those vllm-router 0.1.17 (``--vllm-pd-disaggregation``) and smg 1.13.0
(``--pd-disaggregation``, HTTP workers it detects as vLLM) were seen sending to these engines
on loopback (bench/results/2026-12-06-pd-routing/README.md):

- vllm-router: the prefill first, alone: the client's request with ``max_tokens`` 1,
  ``min_tokens`` 1, ``stream`` false, fields vLLM ignores (``no_stop_trim``,
  ``separate_reasoning``, ...) and ``kv_transfer_params`` asking to keep the blocks; then the
  client's request to the decode with the ``kv_transfer_params`` that prefill answered. Both
  carry one ``X-Request-ID``.
- smg over HTTP: the prefill first (``max_tokens`` 1, ``stream`` false), then the client's
  request to the decode, neither with ``kv_transfer_params``: vLLM with the NIXL connector then
  keeps nothing on the prefill and computes the whole prompt on the decode (smg relays KV
  parameters only to workers it reaches over gRPC).

The live test runs the installed peers themselves (``make bench-peers``) in front of the
engines.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.engine.kv_transfer import TransferConfig
from kvroute.sim.server import SimEngineThread
from kvroute.testbed.peers import find_peers
from kvroute.testbed.procs import Child, ProcessGroup, free_port

SYSTEM = "Prefill and decode engines split the work of serving one request between them. " * 8
MODEL = "kvroute-sim"


def _engine(role: str) -> SimEngineThread:
    cfg = EngineConfig(
        speed=50.0, num_blocks=512, max_model_len=2048, kv_transfer=TransferConfig(role)
    )
    return SimEngineThread(cfg)


@pytest.fixture
def pair() -> Iterator[tuple[SimEngineThread, SimEngineThread]]:
    with _engine("kv_producer") as producer, _engine("kv_consumer") as consumer:
        yield producer, consumer


def _state(engine: SimEngineThread) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(engine.url + "/sim/state", timeout=5).json()
    return out


def _chat(text: str, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **kw}


def _stream(url: str, body: dict[str, Any], headers: dict[str, str]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]


def test_vllm_router_pd_requests_make_the_decode_pull(
    pair: tuple[SimEngineThread, SimEngineThread],
) -> None:
    producer, consumer = pair
    client = _chat(SYSTEM + "What does the decode pull?", max_tokens=6, stream=True)
    headers = {"X-Request-ID": "___prefill_addr_p___decode_addr_d_0123456789abcdef"}
    prefill = {
        **client,
        "stream": False, "max_tokens": 1, "min_tokens": 1, "logprobs": False,
        "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
        "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
        "return_hidden_states": False, "include_reasoning": True,
        "kv_transfer_params": {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None,
        },
    }  # fmt: skip
    resp = httpx.post(
        producer.url + "/v1/chat/completions", json=prefill, headers=headers, timeout=30
    )
    assert resp.status_code == 200, resp.text
    params = resp.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    assert _state(producer)["kv_transfer"]["leases_held"] == 1

    extra = {k: prefill[k] for k in ("no_stop_trim", "separate_reasoning", "include_reasoning")}
    decode = {**client, **extra, "kv_transfer_params": params}
    chunks = _stream(consumer.url + "/v1/chat/completions", decode, headers)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    kv = _state(consumer)["kv_transfer"]
    assert kv["pulls"] == {"ok": 1} and kv["blocks_pulled"] == len(params["remote_block_ids"][0])
    produced = _state(producer)["kv_transfer"]
    assert produced["leases_held"] == 0 and produced["leases_pulled"] == 1


def test_smg_pd_requests_over_http_transfer_nothing(
    pair: tuple[SimEngineThread, SimEngineThread],
) -> None:
    producer, consumer = pair
    client = _chat(SYSTEM + "What does smg send?", max_tokens=6, stream=True)
    prefill = {**client, "logprobs": False, "max_tokens": 1, "stream": False}
    resp = httpx.post(producer.url + "/v1/chat/completions", json=prefill, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["kv_transfer_params"] is None  # nothing kept for a decode
    assert _state(producer)["kv_transfer"]["leases_granted"] == 0

    queried = _state(consumer)["prefix_cache_queries"]
    chunks = _stream(consumer.url + "/v1/chat/completions", {**client, "logprobs": False}, {})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    state = _state(consumer)
    assert state["kv_transfer"]["pulls"] == {} and state["kv_transfer"]["blocks_pulled"] == 0
    # the decode engine looked the whole prompt up in its own cache (and computed the rest)
    prompt = int(
        httpx.post(consumer.url + "/tokenize", json=_chat(SYSTEM + "What does smg send?")).json()[
            "count"
        ]
    )
    assert state["prefix_cache_queries"] - queried == prompt


def _ready(url: str, child: Child, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert child.popen.poll() is None, f"the peer router exited:\n{child.tail()}"
        try:
            if httpx.get(url + "/v1/models", timeout=2).json()["data"][0]["id"] == MODEL:
                return
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not ready")


PEERS = find_peers()


@pytest.mark.skipif(
    PEERS.smg is None or PEERS.vllm_router is None, reason=PEERS.note or "peers not installed"
)
@pytest.mark.parametrize("peer", ["vllm-router", "smg"])
def test_the_installed_peers_pd_modes_against_the_engines(
    pair: tuple[SimEngineThread, SimEngineThread], peer: str, tmp_path: Path
) -> None:
    producer, consumer = pair
    port = free_port()
    common = ["--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
              "--prefill", producer.url, "--decode", consumer.url,
              "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
    if peer == "vllm-router":
        argv = [str(PEERS.vllm_router), "--vllm-pd-disaggregation", *common]
    else:
        argv = [str(PEERS.smg), "launch", "--pd-disaggregation", *common]
    with ProcessGroup(tmp_path) as pg:  # smg's launcher starts the router as its child
        child = pg.start(peer, [*argv, "--log-level", "warn" if peer == "smg" else "warning"])
        url = f"http://127.0.0.1:{port}"
        _ready(url, child)
        client = _chat(SYSTEM + f"Through {peer}?", max_tokens=6, stream=True)
        chunks = _stream(url + "/v1/chat/completions", client, {})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    pulled = _state(consumer)["kv_transfer"]["pulls"]
    leases = _state(producer)["kv_transfer"]["leases_granted"]
    if peer == "vllm-router":
        assert pulled == {"ok": 1} and leases == 1
    else:  # smg relays no kv_transfer_params to HTTP workers: nothing kept, nothing pulled
        assert pulled == {} and leases == 0
