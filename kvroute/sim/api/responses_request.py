"""Parsing a /v1/responses body as vLLM 0.33 does for a chat-template model (no Harmony):
its checks, its conversation (`kvroute.responses_input`), and the fields it echoes back."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvroute.responses_input import (
    ResponsesInputError,
    chat_messages,
    chat_tools,
    continues_final_message,
)
from kvroute.sim.api.errors import bad_request, not_found
from kvroute.sim.api.requests import ParsedRequest, Sampling, int_list, resolve_model
from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.tokenizer import ChatTemplateError, SimTokenizer


@dataclass(slots=True)
class ParsedResponses:
    """A checked Responses request: what the engine runs and what the answer echoes."""

    run: ParsedRequest  # one prompt; max_tokens already the effective limit
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the answer repeats


def _number(body: Mapping[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"{key} must be a number", key)
    return float(value)


def _opt(body: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(key)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise bad_request(f"{key} has the wrong type", key)
    return value


def _flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{key} must be a boolean", key)
    return value


def _tool_choice(body: Mapping[str, Any]) -> Any:
    """vLLM's tool_choice without tools: "auto"/"none" become "none", others are refused."""
    choice = body.get("tool_choice", "auto")
    if body.get("tools"):
        return choice
    if choice in ("auto", "none", None):
        return "none"
    if choice == "required":
        raise bad_request(
            "Tool choice 'required' must be specified with 'tools' parameter.", "tool_choice"
        )
    raise bad_request("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")


def _check_unsupported(body: Mapping[str, Any]) -> None:
    """Requests vLLM refuses before rendering (store is off, as in vLLM by default)."""
    if body.get("prompt") is not None:
        raise bad_request("prompt template is not supported", "prompt")
    if body.get("background") and body.get("store", True):
        raise bad_request(
            "This vLLM engine does not support `store=True` and therefore does not support "
            "the background mode. To enable these features, set the environment variable "
            "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
            "background",
        )
    if body.get("background"):
        raise bad_request("background can only be used when `store` is true", "background")
    prev = body.get("previous_response_id")
    if prev is not None:
        # Nothing is stored, so no earlier response can be found.
        raise not_found(f"Response with id '{prev}' not found.", "response_id")


def render_responses(body: Mapping[str, Any], tok: SimTokenizer) -> tuple[str, list[int]]:
    """(prompt text, token ids) vLLM prefills for a Responses body: its conversation rendered
    with the chat template, then tokenized with special tokens added (the Responses
    endpoint's tokenizer setting, unlike chat completions')."""
    try:
        messages = chat_messages(body)
        tools = chat_tools(body.get("tools"))
    except ResponsesInputError as exc:
        raise bad_request(str(exc), exc.param) from exc
    if not messages:
        raise bad_request("input must not be empty", "input")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    cont = continues_final_message(body.get("input"))
    try:
        text = tok.render_chat(
            messages,
            tools=tools,
            add_generation_prompt=not cont,
            continue_final_message=cont,
            chat_template_kwargs=kwargs,
        )
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "input") from exc
    return text, tok.encode(text, add_special_tokens=True)


def parse_responses(body: Any, config: EngineConfig, tok: SimTokenizer) -> ParsedResponses:
    """A /v1/responses body, checked, rendered and tokenized; ApiError (400, 404) otherwise."""
    if not isinstance(body, Mapping):
        raise bad_request("request body must be a JSON object")
    if not isinstance(body.get("input"), str | list):
        raise bad_request("input must be a string or a list of items", "input")
    model, lora = resolve_model(config, body.get("model"))
    _check_unsupported(body)
    tool_choice = _tool_choice(body)
    text, ids = render_responses(body, tok)
    if len(ids) >= config.max_model_len:
        raise bad_request(
            f"The engine prompt length {len(ids)} exceeds the max_model_len "
            f"{config.max_model_len}. Please reduce prompt.",
            "input",
        )
    room = config.max_model_len - len(ids)
    requested = _opt(body, "max_output_tokens", int)
    if requested is not None and requested < 1:
        raise bad_request("max_output_tokens must be at least 1", "max_output_tokens")
    max_tokens = room if requested is None else min(requested, room)
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad_request("Parameter 'cache_salt' must be a non-empty string if provided.")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    stop_ids = body.get("stop_token_ids")
    sampling = Sampling(
        max_tokens=max_tokens,
        stop=list(stop) if isinstance(stop, list) else [],
        stop_token_ids=[] if stop_ids is None else int_list(stop_ids, "stop_token_ids"),
        include_stop_str_in_output=_flag(body, "include_stop_str_in_output", False),
        ignore_eos=_flag(body, "ignore_eos", False),
        seed=_opt(body, "seed", int),
    )
    stream = _flag(body, "stream", False)
    run = ParsedRequest(
        model, lora, [ids], sampling, stream, False, False, salt, False, False, [text]
    )
    parallel = body.get("parallel_tool_calls")
    echo = {
        "instructions": _opt(body, "instructions", str),
        "metadata": _opt(body, "metadata", dict),
        "parallel_tool_calls": True if parallel is None else parallel,
        "temperature": _number(body, "temperature", 1.0),
        "tool_choice": tool_choice,
        "tools": body.get("tools") or [],
        "top_p": _number(body, "top_p", 1.0),
        "background": False,
        "max_output_tokens": max_tokens,
        "max_tool_calls": _opt(body, "max_tool_calls", int),
        "previous_response_id": None,
        "prompt": None,
        "prompt_cache_options": None,
        "prompt_cache_key": _opt(body, "prompt_cache_key", str),
        "prompt_cache_retention": body.get("prompt_cache_retention"),
        "reasoning": body.get("reasoning"),
        "safety_identifier": _opt(body, "safety_identifier", str),
        "service_tier": body.get("service_tier") or "auto",
        "text": body.get("text"),
        "top_logprobs": _top_logprobs(body),
        "truncation": body.get("truncation", "disabled"),
        "user": _opt(body, "user", str),
        "presence_penalty": _number(body, "presence_penalty", 0.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0),
    }
    return ParsedResponses(run, echo)


def _top_logprobs(body: Mapping[str, Any]) -> int | None:
    """vLLM echoes the sampling logprobs: top_logprobs only when output logprobs are asked."""
    include = body.get("include")
    if isinstance(include, list) and "message.output_text.logprobs" in include:
        value = body.get("top_logprobs") or 0
        return value if isinstance(value, int) else 0
    return None
