"""The simulated engine's HTTP API, over a real socket, against vLLM's response shapes.

vLLM is not importable in the main environment, so shapes are checked against the field lists
of vLLM 0.33's pydantic models (vllm/entrypoints/openai/*/protocol.py, serve/engine/protocol.py,
serve/tokenize/protocol.py), written out below.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.server import SimEngineThread

# vLLM 0.33 field names (model_dump() of the response models).
CHAT_RESPONSE = {
    "id",
    "object",
    "created",
    "model",
    "choices",
    "service_tier",
    "system_fingerprint",
    "usage",
    "prompt_logprobs",
    "prompt_token_ids",
    "prompt_text",
    "kv_transfer_params",
    "ec_transfer_params",
    "metrics",
}
CHAT_CHOICE = {
    "index",
    "message",
    "logprobs",
    "finish_reason",
    "stop_reason",
    "token_ids",
    "routed_experts",
    "weight_versions",
}
CHAT_MESSAGE = {"role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"}
COMPLETION_RESPONSE = {
    "id",
    "object",
    "created",
    "model",
    "choices",
    "service_tier",
    "system_fingerprint",
    "usage",
    "kv_transfer_params",
    "ec_transfer_params",
    "metrics",
}
COMPLETION_CHOICE = {
    "index",
    "text",
    "logprobs",
    "finish_reason",
    "stop_reason",
    "token_ids",
    "prompt_logprobs",
    "prompt_token_ids",
    "routed_experts",
    "weight_versions",
}
USAGE = {
    "prompt_tokens",
    "total_tokens",
    "completion_tokens",
    "prompt_tokens_details",
    "completion_tokens_details",
}
MODEL_CARD = {
    "id",
    "object",
    "created",
    "owned_by",
    "root",
    "parent",
    "max_model_len",
    "permission",
}
ERROR_INFO = {"message", "type", "param", "code"}

LONG = "The router sends warm prefixes to the engine that already caches them. " * 12


@pytest.fixture(scope="module")
def sim() -> Iterator[SimEngineThread]:
    config = EngineConfig(
        speed=200, num_blocks=1024, max_model_len=2048, lora_adapters=("adapter-a",)
    )
    with SimEngineThread(config) as s:
        yield s


@pytest.fixture(scope="module")
def client(sim: SimEngineThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sim.url, timeout=20) as c:
        yield c


def chat(content: str, **kw: Any) -> dict[str, Any]:
    return {"model": "kvroute-sim", "messages": [{"role": "user", "content": content}], **kw}


def sse(client: httpx.Client, path: str, body: dict[str, Any]) -> list[Any]:
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_models_lists_base_model_and_lora_adapters(client: httpx.Client) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    cards = {c["id"]: c for c in body["data"]}
    assert set(cards) == {"kvroute-sim", "adapter-a"}
    for card in cards.values():
        assert set(card) == MODEL_CARD and card["object"] == "model"
    assert cards["adapter-a"]["parent"] == "kvroute-sim"
    assert cards["kvroute-sim"]["max_model_len"] == 2048


def test_chat_completion_shape_and_real_cached_tokens(client: httpx.Client) -> None:
    first = client.post("/v1/chat/completions", json=chat(LONG, max_tokens=8)).json()
    assert set(first) == CHAT_RESPONSE
    assert first["object"] == "chat.completion" and first["id"].startswith("chatcmpl-")
    (choice,) = first["choices"]
    assert set(choice) == CHAT_CHOICE and set(choice["message"]) == CHAT_MESSAGE
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    usage = first["usage"]
    assert set(usage) == USAGE
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    again = client.post("/v1/chat/completions", json=chat(LONG, max_tokens=8)).json()
    n = again["usage"]["prompt_tokens"]
    # vLLM's rule for one full-attention group of block 16: (n - 1) floored to 16.
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
    # Same prompt, same answer (deterministic generation).
    assert again["choices"][0]["message"] == choice["message"]


def test_cache_salt_and_lora_are_separate_namespaces(client: httpx.Client) -> None:
    text = "namespaces keep tenants apart " * 20
    client.post("/v1/chat/completions", json=chat(text, max_tokens=2))
    salted = client.post("/v1/chat/completions", json=chat(text, max_tokens=2, cache_salt="t1"))
    assert salted.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    salted2 = client.post("/v1/chat/completions", json=chat(text, max_tokens=2, cache_salt="t1"))
    assert salted2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    lora = client.post(
        "/v1/chat/completions", json={**chat(text, max_tokens=2), "model": "adapter-a"}
    )
    assert lora.json()["model"] == "adapter-a"
    assert lora.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_chat_streaming_with_usage(client: httpx.Client) -> None:
    body = chat(LONG + " stream", max_tokens=6, stream=True, stream_options={"include_usage": True})
    chunks = sse(client, "/v1/chat/completions", body)
    first, *middle, last_choice, usage_chunk = chunks
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["id"] == first["id"] for c in chunks)
    assert last_choice["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["choices"][0]["finish_reason"] is None for c in middle)
    assert usage_chunk["choices"] == []
    assert all("system_fingerprint" not in c for c in chunks)  # an unnamed engine, as vLLM
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == len(middle) + 1
    assert "cached_tokens" in usage["prompt_tokens_details"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1])
    plain = client.post("/v1/chat/completions", json=chat(LONG + " stream", max_tokens=6)).json()
    assert text == plain["choices"][0]["message"]["content"]


def test_streaming_without_usage_has_no_usage_chunk(client: httpx.Client) -> None:
    chunks = sse(client, "/v1/chat/completions", chat("short one", max_tokens=3, stream=True))
    assert all("usage" not in c for c in chunks)


def test_completions_shape_stream_and_batch(client: httpx.Client) -> None:
    body = client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 5}).json()
    assert set(body) == COMPLETION_RESPONSE and body["object"] == "text_completion"
    assert set(body["choices"][0]) == COMPLETION_CHOICE
    batch = client.post("/v1/completions", json={"prompt": ["one", "two"], "max_tokens": 3})
    assert [c["index"] for c in batch.json()["choices"]] == [0, 1]
    chunks = sse(
        client,
        "/v1/completions",
        {
            "prompt": LONG,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 4
    assert all(c["object"] == "text_completion" for c in chunks)
    ids = client.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 2})
    assert ids.json()["usage"]["prompt_tokens"] == 4


def test_max_tokens_stop_strings_and_return_token_ids(client: httpx.Client) -> None:
    body = chat("count " * 30, max_tokens=3, ignore_eos=True, return_token_ids=True)
    r = client.post("/v1/chat/completions", json=body).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert len(r["choices"][0]["token_ids"]) == 3 == r["usage"]["completion_tokens"]
    full = client.post(
        "/v1/chat/completions", json=chat("count " * 30, max_tokens=30, ignore_eos=True)
    ).json()
    words = full["choices"][0]["message"]["content"].split()
    stop = words[2]
    cut = client.post(
        "/v1/chat/completions",
        json=chat("count " * 30, max_tokens=30, ignore_eos=True, stop=[stop]),
    ).json()
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert stop not in choice["message"]["content"]
    assert full["choices"][0]["message"]["content"].startswith(choice["message"]["content"])


def test_render_endpoints_return_the_ids_the_engine_uses(client: httpx.Client) -> None:
    body = chat("render me " * 5, cache_salt="s")
    rendered = client.post("/v1/chat/completions/render", json=body).json()
    tokenized = client.post("/tokenize", json=body).json()
    run = client.post(
        "/v1/chat/completions", json={**body, "max_tokens": 1, "return_token_ids": True}
    ).json()
    assert rendered["token_ids"] == tokenized["tokens"] == run["prompt_token_ids"]
    assert rendered["cache_salt"] == "s" and rendered["token_ids"][0] == 0  # BOS from template
    comp = client.post("/v1/completions/render", json={"prompt": "hello there"}).json()
    assert isinstance(comp, list) and len(comp) == 1
    assert (
        comp[0]["token_ids"]
        == client.post("/tokenize", json={"prompt": "hello there"}).json()["tokens"]
    )


def test_tokenize_detokenize(client: httpx.Client) -> None:
    tok = client.post(
        "/tokenize", json={"prompt": "caches and routers", "return_token_strs": True}
    ).json()
    assert set(tok) == {"count", "max_model_len", "tokens", "token_strs"}
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"])
    detok = client.post("/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok == {"prompt": "caches and routers"}
    no_special = client.post("/tokenize", json={"prompt": "x", "add_special_tokens": False})
    assert no_special.json()["tokens"] == tok["tokens"][1:2] or no_special.json()["count"] >= 1


def test_errors_have_vllm_shape(client: httpx.Client) -> None:
    cases = [
        (
            "/v1/chat/completions",
            {"model": "missing", "messages": [{"role": "user", "content": "x"}]},
            404,
        ),
        ("/v1/chat/completions", {"messages": []}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
        ("/v1/completions", {"prompt": "x" * 20000}, 400),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, 400),
        ("/v1/completions", {"prompt": "hi", "n": 2}, 400),
        ("/detokenize", {"tokens": [-1]}, 400),
    ]
    for path, body, status in cases:
        r = client.post(path, json=body)
        assert r.status_code == status, (path, body, r.text)
        err = r.json()["error"]
        assert set(err) == ERROR_INFO and err["code"] == status
    bad = client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"


def test_unknown_request_fields_are_ignored(client: httpx.Client) -> None:
    body = chat(
        "extra fields",
        max_tokens=2,
        no_stop_trim=True,
        skip_special_tokens=True,
        separate_reasoning=True,
        logprobs=False,
        echo=False,
    )
    assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_health_metrics_and_event_sources(sim: SimEngineThread, client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    text = client.get("/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
    ):
        lines = [line for line in text.splitlines() if line.startswith(name + "{")]
        assert lines and all('model_name="kvroute-sim"' in line for line in lines), name
    sources = client.get("/kv_event_sources").json()
    assert sources["0"]["endpoint"] == sim.events
    assert sources["0"]["replay_endpoint"] == sim.replay
    assert sources["0"]["publisher"] == "zmq" and sources["0"]["enable_kv_cache_events"]


def test_probe_answers_the_hit_without_side_effects(client: httpx.Client) -> None:
    body = chat("probe prompt " * 20)
    before = client.post("/sim/probe", json=body).json()
    assert before["cached_tokens"] == 0
    run = client.post("/v1/chat/completions", json={**body, "max_tokens": 1}).json()
    after = client.post("/sim/probe", json=body).json()
    again = client.post("/v1/chat/completions", json={**body, "max_tokens": 1}).json()
    assert after["prompt_tokens"] == run["usage"]["prompt_tokens"]
    assert after["cached_tokens"] == again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_waiting_queue_is_bounded() -> None:
    config = EngineConfig(
        speed=0.05, num_blocks=512, max_model_len=1024, max_num_seqs=1, max_waiting=2
    )
    with SimEngineThread(config) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        codes: list[int] = []
        threads: list[threading.Thread] = []
        scheduler = s.engine.scheduler

        def send(i: int) -> None:
            # 400 tokens take minutes at this speed: nothing leaves the engine until the
            # restart below ends them
            body = {"prompt": [10 + i] * 50, "max_tokens": 400, "ignore_eos": True}
            codes.append(c.post("/v1/completions", json=body).status_code)

        def start(i: int) -> None:
            threads.append(threading.Thread(target=send, args=(i,)))
            threads[-1].start()

        def settles(predicate: Callable[[], bool]) -> None:
            deadline = time.monotonic() + 10
            while not predicate() and time.monotonic() < deadline:
                time.sleep(0.005)
            assert predicate()

        # One at a time, so the scheduler has moved the first to running before the others
        # arrive (sent together, two could be refused while the first still waited, leaving
        # room for the request this test expects refused)
        start(0)
        settles(lambda: scheduler.num_running == 1)
        start(1)
        start(2)
        settles(lambda: scheduler.num_waiting == 2)
        assert s.engine.rejected == 0  # up to the bound, everything is taken
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
        assert s.engine.rejected == 1 and s.engine.peak_waiting == 2
        c.post("/sim/faults", json={"restart": True})  # fail the rest quickly
        for t in threads:
            t.join(10)
        assert len(codes) == 3 and 200 not in codes  # the restart ended them, none finished


def test_streamed_role_chunk_comes_with_the_first_token_as_in_vllm() -> None:
    """vLLM emits the role chunk with the engine's first output (after the prefill); a router
    that treats the first byte as the end of prefill must see the prefill's time here too."""
    config = EngineConfig(speed=0.05, num_blocks=1024, max_model_len=4096)
    with SimEngineThread(config) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        body = chat(LONG * 2, max_tokens=2, stream=True)
        arrivals: list[tuple[float, dict[str, Any]]] = []
        t0 = time.perf_counter()
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append((time.perf_counter() - t0, json.loads(line[6:])))
        (t_role, role), (t_token, token) = arrivals[0], arrivals[1]
        assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert token["choices"][0]["delta"]["content"]
        # the prefill of ~300 tokens at 1/20 of the modelled H100 takes tens of ms
        assert t_token > 0.02
        assert t_role > 0.8 * t_token
