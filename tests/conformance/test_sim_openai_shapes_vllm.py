"""The simulated engine's `/v1/responses` and `/v1/embeddings` answers against vLLM 0.33's own
classes and functions (run with the vLLM environment's Python, KVROUTE_VLLM_PYTHON).

For each request the sim answered, vLLM's `ResponsesResponse.from_request` builds the response
from the same request, the same output items and usage: the sim's JSON must be exactly that
dump (every field, every echoed request field, vLLM's defaults). Every streamed event must be
valid to the event class vLLM's streaming code builds for its type, dump to itself, and come
in vLLM's order. An embeddings answer must dump to itself through `EmbeddingResponse`, count
the prompt tokens vLLM's tokenizer gives the input, and encode base64 as vLLM's own encoder
does. (No vLLM server runs here: it needs model weights; the classes decide shapes.)
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from vllm_recording import vllm_python

from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.model import MODEL_DIR
from kvroute.sim.server import SimEngineThread

pytestmark = pytest.mark.vllm
MAX_MODEL_LEN = 2048

_SCRIPT = r"""
import json, sys, typing
from pydantic import BaseModel
from vllm.entrypoints.openai.responses import protocol, streaming_events
from vllm.entrypoints.openai.responses.protocol import (
    ResponsesRequest, ResponsesResponse, ResponseUsage)

job = json.load(sys.stdin)
dump = lambda m: m.model_dump(mode="json", by_alias=True)

# The event classes vLLM's streaming code builds, by their `type` (its own overrides of the
# response events first). Its StreamingResponsesResponse union lacks the text events.
EVENTS = {}
for module in (protocol, streaming_events):
    for cls in vars(module).values():
        if isinstance(cls, type) and issubclass(cls, BaseModel):
            fields = cls.model_fields
            if "type" in fields and "sequence_number" in fields:
                for literal in typing.get_args(fields["type"].annotation):
                    EVENTS.setdefault(literal, cls)


def reference(body, mine, prompt_tokens):
    req = ResponsesRequest.model_validate(body)
    sampling = req.to_sampling_params(job["max_model_len"] - prompt_tokens, {})
    usage = mine["usage"] and ResponseUsage.model_validate(mine["usage"])
    made = ResponsesResponse.from_request(
        req, sampling, model_name=mine["model"], created_time=mine["created_at"],
        output=mine["output"], status=mine["status"], usage=usage)
    out = dump(made)
    out["id"] = mine["id"]  # vLLM's id is the request's own random one
    return out


out = []
for case in job["cases"]:
    body, n = case["body"], case["prompt_tokens"]
    got = {"whole": None, "events": []}
    if case.get("whole") is not None:
        got["whole"] = reference(body, case["whole"], n)
    for name, data in case.get("events", []):
        event = EVENTS[name].model_validate(data)
        again = dump(event)
        if "response" in data:
            again["response"] = reference(body, data["response"], n)
        got["events"].append(again)
    out.append(got)
json.dump(out, sys.stdout)
"""


_EMBED_SCRIPT = r"""
import json, sys
from types import SimpleNamespace
import torch
from pydantic import TypeAdapter
from vllm.entrypoints.pooling.embed.protocol import EmbeddingRequest, EmbeddingResponse
from vllm.entrypoints.pooling.utils import encode_pooling_output_base64
from vllm.tokenizers.registry import get_tokenizer

job = json.load(sys.stdin)
tok = get_tokenizer(job["model_dir"])
out = []
for case in job["cases"]:
    req = TypeAdapter(EmbeddingRequest).validate_python(case["body"])
    texts = req.input if isinstance(req.input, list) else [req.input]
    tokens = sum(len(tok(t, add_special_tokens=req.add_special_tokens)["input_ids"])
                 for t in texts)
    answer = case["answer"]
    base64 = [encode_pooling_output_base64(
                  SimpleNamespace(outputs=SimpleNamespace(data=torch.tensor(v))),
                  "float32", req.endianness)
              for v in case["floats"]]
    out.append({
        "dump": EmbeddingResponse.model_validate(answer).model_dump(mode="json"),
        "prompt_tokens": tokens,
        "base64": base64,
    })
json.dump(out, sys.stdout)
"""


def _vllm(job: dict[str, Any], script: str = _SCRIPT) -> list[dict[str, Any]]:
    done = subprocess.run(
        [str(vllm_python()), "-c", script],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out: list[dict[str, Any]] = json.loads(done.stdout)
    return out


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    config = EngineConfig(speed=200, num_blocks=1024, max_model_len=MAX_MODEL_LEN)
    with SimEngineThread(config) as sim, httpx.Client(base_url=sim.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def pooling() -> Iterator[httpx.Client]:
    config = EngineConfig(speed=200, num_blocks=1024, max_model_len=MAX_MODEL_LEN, runner="pooling")
    with SimEngineThread(config) as sim, httpx.Client(base_url=sim.url, timeout=30) as c:
        yield c


def _events(c: httpx.Client, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    with c.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    out = []
    for block in filter(None, raw.split("\n\n")):
        name, data = block.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


BODIES: list[dict[str, Any]] = [
    {"model": "kvroute-sim", "input": "Tell me about prefix caching.", "max_output_tokens": 5},
    {
        "model": "kvroute-sim",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
            {"type": "message", "role": "assistant", "content": "hi"},
            {"role": "user", "content": "and then?"},
        ],
        "max_output_tokens": 4,
        "temperature": 0.5,
        "top_p": 0.9,
        "metadata": {"team": "routing"},
        "user": "u-1",
        "store": False,
        "truncation": "auto",
        "presence_penalty": 0.25,
    },
    # every token of the sim starts with a space: stopped at once, no text, status completed
    {"model": "kvroute-sim", "input": "Count to ten.", "max_output_tokens": 64, "stop": [" "]},
]


def test_responses_answers_are_vllms_shapes(client: httpx.Client) -> None:
    cases = []
    for body in BODIES:
        whole = client.post("/v1/responses", json=body)
        assert whole.status_code == 200, whole.text
        mine = whole.json()
        cases.append(
            {
                "body": body,
                "prompt_tokens": mine["usage"]["input_tokens"],
                "whole": mine,
                "events": _events(client, body),
            }
        )
    got = _vllm({"max_model_len": MAX_MODEL_LEN, "cases": cases})
    statuses = set()
    outputs = []
    for case, ref in zip(cases, got, strict=True):
        assert case["whole"] == ref["whole"]
        statuses.add(case["whole"]["status"])
        names = [name for name, _ in case["events"]]
        assert [data for _, data in case["events"]] == ref["events"]
        assert all(name == data["type"] for name, data in case["events"])
        terminal = f"response.{case['whole']['status']}"
        deltas = names.count("response.output_text.delta")
        text = [
            "response.output_item.added",
            "response.content_part.added",
            *["response.output_text.delta"] * deltas,
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
        ]
        # no text at all (stopped at once): vLLM opens no output item in the stream
        middle = text if deltas else []
        assert names == ["response.created", "response.in_progress", *middle, terminal]
        outputs.append(deltas)
    assert statuses == {"completed", "incomplete"}
    assert outputs[0] > 0 and outputs[-1] == 0


EMBED_INPUTS: list[Any] = [
    "The router keeps warm prefixes together.",
    ["first text to embed", "a second, longer text to embed than the first one"],
]


def test_embeddings_answers_are_vllms_shapes(pooling: httpx.Client) -> None:
    cases = []
    for value in EMBED_INPUTS:
        for fmt, order in (("float", "native"), ("base64", "native"), ("base64", "big")):
            body = {"model": "kvroute-sim", "input": value, "encoding_format": fmt}
            if order != "native":
                body["endianness"] = order
            r = pooling.post("/v1/embeddings", json=body)
            assert r.status_code == 200, r.text
            floats = pooling.post("/v1/embeddings", json={**body, "encoding_format": "float"})
            vectors = [d["embedding"] for d in floats.json()["data"]]
            cases.append({"body": body, "answer": r.json(), "floats": vectors})
    got = _vllm({"model_dir": str(MODEL_DIR), "cases": cases}, _EMBED_SCRIPT)
    for case, ref in zip(cases, got, strict=True):
        answer = case["answer"]
        assert answer == ref["dump"]
        assert answer["id"].startswith("embd-") and answer["object"] == "list"
        assert answer["usage"]["prompt_tokens"] == ref["prompt_tokens"]
        assert answer["usage"]["total_tokens"] == ref["prompt_tokens"]
        n = 1 if isinstance(case["body"]["input"], str) else len(case["body"]["input"])
        assert [d["index"] for d in answer["data"]] == list(range(n))
        if case["body"]["encoding_format"] == "base64":
            assert [d["embedding"] for d in answer["data"]] == ref["base64"]
        else:
            for vector in case["floats"]:
                assert abs(sum(v * v for v in vector) - 1.0) < 1e-5  # normalised, as vLLM's


def test_a_generate_engine_has_no_embeddings_route(client: httpx.Client) -> None:
    r = client.post("/v1/embeddings", json={"model": "kvroute-sim", "input": "x"})
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
