"""A `/v1/responses` request's prompt, as the router's local tokenizer and the simulated engine
compute it, against vLLM's own conversion and rendering (`vllm_render_oracle.py`): the same
chat messages (`kvroute.responses_input`), and the same token ids on every fixture model and
on the simulated engine's model."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from tokenize_helpers import Oracle

from kvroute.responses_input import chat_messages
from kvroute.router.tokenize.chat_request import NotExact
from kvroute.router.tokenize.errors import TokenizeError
from kvroute.router.tokenize.local import LocalTokenizer
from kvroute.router.tokenize.prefix_cache import PrefixCache
from kvroute.router.tokenize.responses_request import responses_chat_body
from kvroute.router.tokenize.spec import TokenizerSpec
from kvroute.sim.api.responses_request import render_responses
from kvroute.sim.model import MODEL_DIR
from kvroute.sim.tokenizer import SimTokenizer

pytestmark = pytest.mark.vllm
RESPONSES = "/v1/responses"

BODIES: list[dict[str, Any]] = [
    {"model": "m", "input": "What is a KV cache?"},
    {"model": "m", "instructions": "Answer in one line.", "input": "Define prefill."},
    {
        "model": "m",
        "input": [
            {"role": "developer", "content": "Be terse."},
            {"role": "user", "content": [{"type": "input_text", "text": "first question"}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "first answer"}],
            },
            {"type": "message", "role": "user", "content": "second question"},
        ],
    },
    {
        "model": "m",
        "instructions": "You route requests.",
        "input": [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi, how can I help?"},
            {"role": "user", "content": [{"type": "input_text", "text": "tell me more"}]},
        ],
    },
    {
        "model": "m",
        "input": [
            {"role": "user", "content": "write a haiku"},
            {
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [{"type": "output_text", "text": "Warm blocks"}],
            },
        ],
    },
    {
        "model": "m",
        "input": [
            {"role": "user", "content": "weather in Paris?"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
    },
]


def _local(model_dir: Path) -> LocalTokenizer:
    return LocalTokenizer.from_spec(
        TokenizerSpec("local", path=str(model_dir)), cache=PrefixCache(64, 1 << 24)
    )


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value))


@pytest.mark.parametrize("index", range(len(BODIES)))
def test_messages_are_vllms(oracle: Oracle, model_dirs: dict[str, Path], index: int) -> None:
    body = BODIES[index]
    before = copy.deepcopy(body)
    want = oracle.ask(model_dirs["chatml"], RESPONSES, body)
    assert "error" not in want, want
    assert _plain(chat_messages(body)) == want["messages"]
    assert body == before, "the request body was mutated"


@pytest.mark.parametrize("kind", ["chatml", "llama3", "metaspace"])
def test_router_ids_are_vllms(oracle: Oracle, model_dirs: dict[str, Path], kind: str) -> None:
    tok = _local(model_dirs[kind])
    compared = 0
    for body in BODIES:
        want = oracle.ask(model_dirs[kind], RESPONSES, body)
        if "error" in want:  # e.g. a template without a tool role: both refuse
            with pytest.raises(TokenizeError):
                tok.chat_ids(responses_chat_body(body))
            continue
        ids, _ = tok.chat_ids(responses_chat_body(body))
        assert ids == want["ids"], (body, tok.render_chat(responses_chat_body(body))[0], want)
        compared += 1
    assert compared >= len(BODIES) - 1


def test_simulated_engine_prefills_vllms_ids(oracle: Oracle) -> None:
    tok = SimTokenizer(MODEL_DIR)
    for body in BODIES:
        want = oracle.ask(Path(MODEL_DIR), RESPONSES, body)
        assert "error" not in want, (body, want)
        text, ids = render_responses(body, tok)
        assert text == want["text"]
        assert ids == want["ids"]


def test_what_the_router_cannot_reproduce_gives_no_ids() -> None:
    for extra, reason in (
        ({"previous_response_id": "resp_1"}, "responses_history"),
        ({"reasoning": {"effort": "low"}}, "responses_reasoning"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "responses_tools"),
    ):
        with pytest.raises(NotExact) as caught:
            responses_chat_body({**BODIES[0], **extra})
        assert caught.value.reason == reason
