"""The simulated engine's `/v1/responses` answers against vLLM 0.33's own classes (run with
the vLLM environment's Python, KVROUTE_VLLM_PYTHON).

For each request the sim answered, vLLM's `ResponsesResponse.from_request` builds the response
from the same request, the same output items and usage: the sim's JSON must be exactly that
dump (every field, every echoed request field, vLLM's defaults). Every streamed event must be
valid to the event class vLLM's streaming code builds for its type, dump to itself, and come
in vLLM's order. (No vLLM server runs here: it needs model weights; the classes decide shapes.)
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


def _vllm(job: dict[str, Any]) -> list[dict[str, Any]]:
    done = subprocess.run(
        [str(vllm_python()), "-c", _SCRIPT],
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
