"""The simulated engine's /v1/responses and /v1/embeddings over a real socket: vLLM's refusals,
its limits, the prefix cache they share with generation, and injected failures. (Their shapes
are checked against vLLM's own classes in tests/conformance/test_sim_openai_shapes_vllm.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.server import SimEngineThread

MODEL = "kvroute-sim"
LONG = "Routing by prefix keeps the prefill short when the cache is warm. " * 12


@pytest.fixture(scope="module")
def gen() -> Iterator[httpx.Client]:
    config = EngineConfig(speed=200, num_blocks=1024, max_model_len=512)
    with SimEngineThread(config) as sim, httpx.Client(base_url=sim.url, timeout=20) as c:
        yield c


@pytest.fixture(scope="module")
def pool() -> Iterator[httpx.Client]:
    config = EngineConfig(speed=200, num_blocks=1024, max_model_len=512, runner="pooling")
    with SimEngineThread(config) as sim, httpx.Client(base_url=sim.url, timeout=20) as c:
        yield c


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert err["code"] == status
    return err


@pytest.mark.parametrize(
    ("extra", "status", "param"),
    [
        ({"previous_response_id": "resp_x"}, 404, "response_id"),  # nothing is stored
        ({"background": True}, 400, "background"),
        ({"tool_choice": "required"}, 400, "tool_choice"),
        ({"prompt": {"id": "p"}}, 400, "prompt"),
        ({"input": [{"type": "web_search_call", "id": "x"}]}, 400, "input"),
        ({"input": 5}, 400, "input"),
        ({"input": LONG * 3}, 400, "input"),  # beyond max_model_len
        ({"max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"model": "nope"}, 404, "model"),
    ],
)
def test_responses_refusals(
    gen: httpx.Client, extra: dict[str, Any], status: int, param: str
) -> None:
    body = {"model": MODEL, "input": "hi", **extra}
    assert _error(gen.post("/v1/responses", json=body), status)["param"] == param


def test_max_output_tokens_is_clamped_to_the_context_and_the_cache_is_reused(
    gen: httpx.Client,
) -> None:
    body = {"model": MODEL, "input": LONG, "max_output_tokens": 100_000, "stop": [" a"]}
    first = gen.post("/v1/responses", json=body).json()
    prompt = first["usage"]["input_tokens"]
    assert first["max_output_tokens"] == 512 - prompt  # vLLM clamps, it does not refuse
    second = gen.post("/v1/responses", json=body).json()
    assert second["usage"]["input_tokens"] == prompt
    # everything but the last partial block came from the cache the first request filled
    assert second["usage"]["input_tokens_details"]["cached_tokens"] == prompt // 16 * 16
    assert first["usage"]["input_tokens_details"]["cache_write_tokens"] == prompt // 16 * 16
    assert second["usage"]["input_tokens_details"]["cache_write_tokens"] == 0


def test_injected_failures_on_responses(gen: httpx.Client) -> None:
    gen.post("/sim/faults", json={"fail_next": 1, "fail_mode": "http"})
    _error(gen.post("/v1/responses", json={"model": MODEL, "input": "x"}), 500)
    gen.post("/sim/faults", json={"fail_next": 1, "fail_mode": "stream"})
    body = {"model": MODEL, "input": "x", "max_output_tokens": 8, "stream": True}
    with gen.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        blocks = [b for b in r.read().decode().split("\n\n") if b]
    names = [b.split("\n")[0].removeprefix("event: ") for b in blocks]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == "error" and "response.completed" not in names
    last = json.loads(blocks[-1].split("\n")[1].removeprefix("data: "))
    assert last["type"] == "error" and last["sequence_number"] == len(blocks) - 1
    gen.post("/sim/faults", json={"fail_next": 0})


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"dimensions": 8}, "dimensions"),
        ({"encoding_format": "bytes"}, "encoding_format"),
        ({"embed_dtype": "float16"}, "embed_dtype"),
        ({"endianness": "middle"}, "endianness"),
        ({"input": []}, "input"),
        ({"input": [{"role": "user", "content": "x"}]}, "input"),
        ({"input": LONG * 3}, "input_tokens"),  # beyond max_model_len
        ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ],
)
def test_embeddings_refusals(pool: httpx.Client, extra: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "input": "hi", **extra}
    assert _error(pool.post("/v1/embeddings", json=body), 400)["param"] == param


def test_embeddings_fill_and_read_the_prefix_cache(pool: httpx.Client) -> None:
    before = pool.get("/sim/state").json()["prefix_cache_hits"]
    first = pool.post("/v1/embeddings", json={"model": MODEL, "input": LONG}).json()
    n = first["usage"]["prompt_tokens"]
    probe = pool.post("/sim/probe", json={"model": MODEL, "prompt": LONG}).json()
    assert probe["cached_tokens"] == n // 16 * 16
    again = pool.post("/v1/embeddings", json={"model": MODEL, "input": [LONG, "other"]}).json()
    assert again["data"][0]["embedding"] == first["data"][0]["embedding"]  # same input
    assert again["data"][1]["embedding"] != first["data"][0]["embedding"]
    assert pool.get("/sim/state").json()["prefix_cache_hits"] > before


def test_a_pooling_engine_serves_no_generation(pool: httpx.Client) -> None:
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        r = pool.post(path, json={"model": MODEL, "input": "x"})
        assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
