"""`send_token_ids` against vLLM's own request and response classes (vLLM 0.33, CPU install).

A chat request and the completion the router sends instead must give the engine the same
sampling parameters, as vLLM's protocol classes compute them; completion answers that vLLM's
classes produce, converted by the router, must be valid chat answers to vLLM's classes. (No
vLLM server runs here: it needs model weights; the classes are the code that decides.)"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from typing import Any

from vllm_recording import vllm_python

from kvroute.router.edge.chat_as_completion import ChatStream, chat_response, completion_body
from kvroute.router.edge.completion_as_ids import CONSUMED, NEEDS_TEXT, completion_ids_body

_SCRIPT = r"""
import json, sys
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest, ChatCompletionResponse, ChatCompletionStreamResponse)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionRequest, CompletionResponse, CompletionResponseChoice,
    CompletionResponseStreamChoice, CompletionStreamResponse)
from vllm.entrypoints.serve.engine.protocol import UsageInfo

job = json.load(sys.stdin)
out = {}
if job["mode"] == "requests":
    diffs = []
    for chat_body, completion in job["pairs"]:
        chat = ChatCompletionRequest.model_validate(chat_body)
        comp = CompletionRequest.model_validate(completion)
        limit = chat.max_completion_tokens or chat.max_tokens
        a = chat.to_sampling_params(limit, {})
        b = comp.to_sampling_params(comp.max_tokens, {})
        fields = [f for f in a.__struct_fields__ if getattr(a, f) != getattr(b, f)]
        diffs.append({"fields": fields, "extra": sorted((comp.model_extra or {}).keys()),
                      "prompt": comp.prompt, "salt": comp.cache_salt,
                      "stream": comp.stream, "usage": bool(comp.stream_options and
                                                           comp.stream_options.include_usage)})
    out["diffs"] = diffs
elif job["mode"] == "completions":
    from types import SimpleNamespace
    model = SimpleNamespace(max_model_len=4096)
    diffs = []
    for text_body, ids_body in job["pairs"]:
        text = CompletionRequest.model_validate(text_body)
        ids = CompletionRequest.model_validate(ids_body)
        a = text.to_sampling_params(text.max_tokens, {})
        b = ids.to_sampling_params(ids.max_tokens, {})
        fields = [f for f in a.__struct_fields__ if getattr(a, f) != getattr(b, f)]
        ta, tb = text.build_tok_params(model), ids.build_tok_params(model)
        tok = [f for f in vars(ta) if getattr(ta, f) != getattr(tb, f)]
        diffs.append({"fields": fields, "tok": tok, "extra": sorted((ids.model_extra or {}).keys()),
                      "prompt": ids.prompt})
    out["diffs"] = diffs
elif job["mode"] == "responses":
    usage = UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    whole = CompletionResponse(model="m", choices=[CompletionResponseChoice(
        index=0, text=" a b", finish_reason="length")], usage=usage, system_fingerprint="w1")
    # as vLLM's completion stream makes them (serving.py: object set, unset fields dropped)
    chunks = [CompletionStreamResponse(id="cmpl-1", created=1, model="m", object="text_completion",
        choices=[CompletionResponseStreamChoice(index=0, text=t, finish_reason=f,
                                                stop_reason=s)])
        for t, f, s in ((" a", None, None), (" b", None, None), ("", "stop", "</s>"))]
    chunks.append(CompletionStreamResponse(id="cmpl-1", created=1, model="m", choices=[],
                                           usage=usage))
    out["whole"] = whole.model_dump_json()
    out["stream"] = "".join(f"data: {c.model_dump_json(exclude_unset=True)}\n\n" for c in chunks)
    out["stream"] += "data: [DONE]\n\n"
elif job["mode"] == "fields":
    out["fields"] = sorted(CompletionRequest.model_fields)
else:
    ChatCompletionResponse.model_validate_json(job["whole"])
    out["chunks"] = [ChatCompletionStreamResponse.model_validate_json(c).model_dump()
                     for c in job["chunks"]]
json.dump(out, sys.stdout)
"""


def _vllm(job: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run(
        [vllm_python(), "-c", _SCRIPT],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout)
    return out


def _converted_by_vllm(
    mode: str,
    convert: Callable[[dict[str, Any], list[int]], bytes | None],
    bodies: list[dict[str, Any]],
    ids: list[int],
) -> list[dict[str, Any]]:
    """vLLM's comparison (`mode` of the script) of each body with its conversion."""
    pairs = []
    for body in bodies:
        converted = convert(body, ids)
        assert converted is not None
        pairs.append([body, json.loads(converted)])
    diffs: list[dict[str, Any]] = _vllm({"mode": mode, "pairs": pairs})["diffs"]
    return diffs


CHAT = [{"role": "user", "content": "hi"}]
PLAIN_BODIES = [
    {"model": "m", "messages": CHAT, "max_tokens": 9},
    {
        "model": "m",
        "messages": CHAT,
        "max_completion_tokens": 33,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "seed": 7,
        "stop": ["\n\n", "END"],
        "stop_token_ids": [2],
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
        "min_tokens": 3,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "include_stop_str_in_output": True,
        "cache_salt": "tenant-a",
        "user": "u1",
        "n": 1,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": False},
        "add_generation_prompt": True,
    },
]


def test_the_completion_asks_the_engine_for_what_the_chat_request_did() -> None:
    ids = [101, 7, 8, 9]
    diffs = _converted_by_vllm("requests", completion_body, PLAIN_BODIES, ids)
    for body, d in zip(PLAIN_BODIES, diffs, strict=True):
        assert d["fields"] == [], (body, d)  # every sampling parameter equal
        assert d["extra"] == []  # no field vLLM's completions endpoint does not know
        assert d["prompt"] == ids and d["salt"] == body.get("cache_salt")
        assert d["stream"] == body.get("stream", False)
    assert diffs[1]["usage"] is True


def test_vllms_completion_answers_become_valid_chat_answers() -> None:
    made = _vllm({"mode": "responses"})
    whole = chat_response(made["whole"].encode())
    stream = ChatStream().convert(made["stream"].encode())
    events = [e[6:] for e in stream.decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    checked = _vllm({"mode": "validate", "whole": whole.decode(), "chunks": events[:-1]})
    chunks = checked["chunks"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == " a b"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 3
    assert json.loads(whole)["choices"][0]["message"]["content"] == " a b"


TEXT_BODIES = [
    {"model": "m", "prompt": "Once upon a time", "max_tokens": 9},
    {
        "model": "m",
        "prompt": "Once upon a time",
        "max_tokens": 33,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 7,
        "stop": ["END"],
        "logprobs": 2,
        "n": 3,
        "echo": False,
        "add_special_tokens": False,
        "cache_salt": "tenant-a",
        "stream": True,
        "stream_options": {"include_usage": True},
    },
]


def test_a_text_completion_sent_as_ids_asks_the_engine_for_the_same() -> None:
    """Same sampling parameters; the tokenizing parameters differ at most in
    `add_special_tokens`, which vLLM applies only when it encodes a text prompt
    (`renderers/base.py`, `_tokenize_singleton_prompt`: a prompt with ids is not encoded)."""
    ids = [1, 7, 8, 9]
    diffs = _converted_by_vllm("completions", completion_ids_body, TEXT_BODIES, ids)
    for body, d in zip(TEXT_BODIES, diffs, strict=True):
        assert d["fields"] == [], (body, d)
        assert set(d["tok"]) <= {"add_special_tokens"}, (body, d)
        assert d["extra"] == [] and d["prompt"] == ids
    assert diffs[1]["tok"] == ["add_special_tokens"]  # False in the text body, default True


# CompletionRequest's fields read as they are whatever the prompt's form (sampling, output
# shape, transfer and tenancy), checked in vLLM 0.33's `completion/protocol.py`; `mm_payload`
# and `return_mm_kwargs` act on the render endpoints only, which the router does not convert.
_SAME_ON_IDS = {
    "allowed_token_ids", "bad_words", "cache_salt", "ec_transfer_params", "frequency_penalty",
    "ignore_eos", "include_stop_str_in_output", "kv_transfer_params", "length_penalty",
    "logit_bias", "logprob_token_ids", "logprobs", "max_tokens", "min_p", "min_tokens",
    "mm_payload", "model", "n", "presence_penalty", "priority", "prompt", "prompt_logprobs",
    "repetition_detection", "repetition_penalty", "request_id", "response_format",
    "return_mm_kwargs", "return_token_ids", "return_tokens_as_token_ids",
    "return_weight_versions", "routed_experts_prompt_start", "seed", "session_id",
    "skip_special_tokens", "spaces_between_special_tokens", "stop", "stop_token_ids", "stream",
    "stream_interval", "stream_options", "structured_outputs", "temperature",
    "thinking_token_budget", "top_k", "top_p", "use_beam_search", "user", "vllm_xargs",
    "watermarking",
}  # fmt: skip


def test_every_completion_field_of_vllm_is_classified() -> None:
    """A field vLLM adds to CompletionRequest fails this until someone decides whether it acts
    on the prompt's text (NEEDS_TEXT) or not; a NEEDS_TEXT name vLLM dropped fails it too."""
    fields = set(_vllm({"mode": "fields"})["fields"])
    text_side = set(NEEDS_TEXT) | CONSUMED
    assert text_side <= fields, sorted(text_side - fields)
    assert not (text_side & _SAME_ON_IDS)
    assert fields - text_side - _SAME_ON_IDS == set(), "new fields: classify them"
    assert _SAME_ON_IDS - fields == set(), "fields vLLM no longer has"
