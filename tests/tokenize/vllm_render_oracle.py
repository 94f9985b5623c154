"""Reference token ids from vLLM's own code, for the equivalence tests.

Run with the vLLM environment's Python (`.venv-vllm/bin/python`). It reads JSON lines
`{"model_dir": ..., "endpoint": "/v1/chat/completions" | "/v1/completions" | "/v1/responses",
"body": {...},
"server": {...}}` on stdin and writes one JSON line per request: `{"ids": [...], "text": ...}` or
`{"error": "..."}`.

A full `vllm launch render` server needs a model config that vLLM can inspect, which pulls in
model code and packages this CPU-only environment does not have. So this drives the same
functions the render server calls for a text-only request, in the same order, with a stand-in
model config that carries only the fields they read:
request validation (pydantic `ChatCompletionRequest` / `CompletionRequest`), tool dicts,
`build_chat_params` + `with_defaults`, `parse_chat_messages` with the detected content format,
`safe_apply_chat_template` (transformers' `apply_chat_template`, `tokenize=False`), and the
tokenizer call with the request's `add_special_tokens`. A Responses request goes through
vLLM's conversion of its input to chat messages (`construct_input_messages`, the tool dicts,
continuation of a partial last item) and the tokenizer settings of its `build_tok_params`;
the answer then also carries the messages (`"messages"`).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
)
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.openai.responses.utils import (
    construct_input_messages,
    construct_tool_dicts,
)
from vllm.renderers.chat_utils import parse_chat_messages
from vllm.renderers.hf import (
    resolve_chat_template_content_format,
    safe_apply_chat_template,
)
from vllm.renderers.params import merge_kwargs
from vllm.tokenizers.registry import get_tokenizer

_TOKENIZERS: dict[str, Any] = {}


def _model_config(model_dir: str, max_model_len: int) -> SimpleNamespace:
    return SimpleNamespace(
        model=model_dir,
        tokenizer=model_dir,
        revision=None,
        code_revision=None,
        tokenizer_revision=None,
        trust_remote_code=False,
        multimodal_config=None,
        enable_prompt_embeds=False,
        max_model_len=max_model_len,
        hf_config=SimpleNamespace(model_type="llama"),
    )


def _tokenizer(model_dir: str) -> Any:
    if model_dir not in _TOKENIZERS:
        _TOKENIZERS[model_dir] = get_tokenizer(model_dir)
    return _TOKENIZERS[model_dir]


def _chat(model_dir: str, body: dict[str, Any], server: dict[str, Any]) -> dict[str, Any]:
    tok = _tokenizer(model_dir)
    mc = _model_config(model_dir, 1 << 20)
    req = ChatCompletionRequest(**body)
    sent_template = req.chat_template is not None or (
        req.chat_template_kwargs and req.chat_template_kwargs.get("chat_template") is not None
    )
    if sent_template and not server.get("trust_request_chat_template", False):
        raise ValueError("untrusted chat template in request")
    exclude_none = server.get("exclude_tools_when_tool_choice_none", False)
    if req.tools is None or (req.tool_choice == "none" and exclude_none):
        tool_dicts = None
    else:
        tool_dicts = [tool.model_dump() for tool in req.tools]
    default_kwargs = merge_kwargs(
        server.get("default_chat_template_kwargs"), dict(tools=tool_dicts, tokenize=False)
    )
    chat_params = req.build_chat_params(
        server.get("chat_template"), server.get("content_format", "auto")
    ).with_defaults(default_kwargs)
    content_format = resolve_chat_template_content_format(
        chat_template=chat_params.chat_template,
        tools=chat_params.chat_template_kwargs.get("tools"),
        given_format=chat_params.chat_template_content_format,
        tokenizer=tok,
        model_config=mc,
    )
    conversation, _, _ = parse_chat_messages(req.messages, mc, content_format=content_format)
    text = safe_apply_chat_template(
        mc, tok, conversation, **chat_params.get_apply_chat_template_kwargs()
    )
    ids = tok(text, add_special_tokens=req.add_special_tokens)["input_ids"]
    return {"ids": list(ids), "text": text, "content_format": content_format}


def _responses(model_dir: str, body: dict[str, Any], server: dict[str, Any]) -> dict[str, Any]:
    tok = _tokenizer(model_dir)
    mc = _model_config(model_dir, 1 << 20)
    req = ResponsesRequest(**body)
    tool_dicts = construct_tool_dicts(req.tools, req.tool_choice)
    messages = construct_input_messages(
        request_instructions=req.instructions, request_input=req.input
    )
    plain = json.loads(json.dumps(messages, default=lambda o: o.model_dump()))
    chat_params = req.build_chat_params(
        server.get("chat_template"), server.get("content_format", "auto")
    ).with_defaults(
        merge_kwargs(
            server.get("default_chat_template_kwargs"), dict(tools=tool_dicts, tokenize=False)
        )
    )
    content_format = resolve_chat_template_content_format(
        chat_template=chat_params.chat_template,
        tools=chat_params.chat_template_kwargs.get("tools"),
        given_format=chat_params.chat_template_content_format,
        tokenizer=tok,
        model_config=mc,
    )
    conversation, _, _ = parse_chat_messages(messages, mc, content_format=content_format)
    text = safe_apply_chat_template(
        mc, tok, conversation, **chat_params.get_apply_chat_template_kwargs()
    )
    add_special = req.build_tok_params(mc).add_special_tokens
    ids = tok(text, add_special_tokens=add_special)["input_ids"]
    return {"ids": list(ids), "text": text, "messages": plain}


def _completion(model_dir: str, body: dict[str, Any]) -> dict[str, Any]:
    tok = _tokenizer(model_dir)
    req = CompletionRequest(**body)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tok(prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        return {"ids": list(ids), "text": prompt}
    return {"ids": list(prompt), "text": None}


def main() -> int:
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        try:
            if msg["endpoint"] == "/v1/chat/completions":
                out = _chat(msg["model_dir"], msg["body"], msg.get("server", {}))
            elif msg["endpoint"] == "/v1/responses":
                out = _responses(msg["model_dir"], msg["body"], msg.get("server", {}))
            else:
                out = _completion(msg["model_dir"], msg["body"])
        except Exception as exc:
            out = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
