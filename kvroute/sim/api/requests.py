"""Parsing OpenAI request bodies into what the engine needs (vLLM's defaults and checks)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvroute.sim.api.errors import bad_request, not_found
from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.tokenizer import ChatTemplateError, SimTokenizer


@dataclass(slots=True)
class Sampling:
    """The sampling parameters the simulated engine honours."""

    max_tokens: int | None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None


@dataclass(slots=True)
class ParsedRequest:
    """A checked completions or chat request, prompts tokenized."""

    model: str
    lora_name: str | None
    prompts: list[list[int]]  # one per choice (completions may batch prompts)
    sampling: Sampling
    stream: bool
    include_usage: bool
    continuous_usage: bool
    cache_salt: str | None
    return_token_ids: bool
    echo: bool = False
    prompt_texts: list[str | None] = field(default_factory=list)
    kv_transfer_params: dict[str, Any] | None = None


def _obj(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise bad_request("request body must be a JSON object")
    return body


def _opt_int(body: Mapping[str, Any], key: str, minimum: int = 0) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise bad_request(f"{key} must be an integer >= {minimum}", key)
    return value


def _bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{key} must be a boolean", key)
    return value


def _str_list(body: Mapping[str, Any], key: str) -> list[str]:
    value = body.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise bad_request(f"{key} must be a string or a list of strings", key)


def int_list(value: Any, key: str) -> list[int]:
    """`value` as a list of token ids; 400 naming `key` otherwise."""
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise bad_request(f"{key} must be a list of non-negative integers", key)
    return list(value)


def resolve_model(config: EngineConfig, model: Any) -> tuple[str, str | None]:
    """(model name as served, LoRA adapter name or None); 404 for unknown models."""
    if model is None:
        return config.model, None
    if not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    if model == config.model:
        return model, None
    if model in config.lora_adapters:
        return model, model
    raise not_found(f"The model `{model}` does not exist. Valid aliases: {config.model}.", "model")


def _sampling(body: Mapping[str, Any], chat: bool) -> Sampling:
    max_tokens = _opt_int(body, "max_completion_tokens", 1) if chat else None
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad_request("seed must be an integer", "seed")
    n = body.get("n", 1)
    if n not in (None, 1):
        raise bad_request("the simulated engine supports only n=1", "n")
    stop_ids = body.get("stop_token_ids")
    return Sampling(
        max_tokens=max_tokens,
        stop=_str_list(body, "stop"),
        stop_token_ids=[] if stop_ids is None else int_list(stop_ids, "stop_token_ids"),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
        ignore_eos=_bool(body, "ignore_eos", False),
        seed=seed,
    )


def _stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool, bool]:
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise bad_request("stream_options must be an object", "stream_options")
    if options and not stream:
        raise bad_request("Stream options can only be defined when `stream=True`.", "stream")
    opts = options or {}
    include = bool(opts.get("include_usage", False))
    continuous = include and bool(opts.get("continuous_usage_stats", False))
    return stream, include, continuous


def _salt(body: Mapping[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise bad_request("Parameter 'cache_salt' must be a non-empty string if provided.")
    return salt


def _kv_params(body: Mapping[str, Any]) -> dict[str, Any] | None:
    value = body.get("kv_transfer_params")
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise bad_request("kv_transfer_params must be an object", "kv_transfer_params")
    return dict(value)


def parse_completion(body: Any, config: EngineConfig, tok: SimTokenizer) -> ParsedRequest:
    """A /v1/completions body, checked and tokenized; ApiError (400, 404) otherwise."""
    b = _obj(body)
    model, lora = resolve_model(config, b.get("model"))
    prompt = b.get("prompt")
    add_special = _bool(b, "add_special_tokens", True)
    texts: list[str | None] = []
    if isinstance(prompt, str):
        prompts, texts = [tok.encode(prompt, add_special)], [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts, texts = [tok.encode(p, add_special) for p in prompt], list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        prompts, texts = [int_list(prompt, "prompt")], [None]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [int_list(p, "prompt") for p in prompt]
        texts = [None] * len(prompts)
    else:
        raise bad_request("prompt must be a string, a list of strings or token ids", "prompt")
    if any(not p for p in prompts):
        raise bad_request("prompt must not be empty", "prompt")
    stream, include, continuous = _stream_flags(b)
    return ParsedRequest(
        model, lora, prompts, _sampling(b, chat=False), stream, include, continuous,
        _salt(b), _bool(b, "return_token_ids", False), _bool(b, "echo", False), texts,
        _kv_params(b),
    )  # fmt: skip


def render_chat(body: Mapping[str, Any], tok: SimTokenizer) -> tuple[str, list[int]]:
    """(prompt text, token ids) of a chat body's messages, rendered with the chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    try:
        text = tok.render_chat(
            messages,
            tools=tools,
            add_generation_prompt=_bool(body, "add_generation_prompt", True),
            continue_final_message=_bool(body, "continue_final_message", False),
            chat_template_kwargs=kwargs,
        )
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from exc
    return text, tok.encode(text, add_special_tokens=_bool(body, "add_special_tokens", False))


def parse_chat(body: Any, config: EngineConfig, tok: SimTokenizer) -> ParsedRequest:
    """A /v1/chat/completions body, checked and rendered; ApiError (400, 404) otherwise."""
    b = _obj(body)
    model, lora = resolve_model(config, b.get("model"))
    text, ids = render_chat(b, tok)
    stream, include, continuous = _stream_flags(b)
    return ParsedRequest(
        model, lora, [ids], _sampling(b, chat=True), stream, include, continuous,
        _salt(b), _bool(b, "return_token_ids", False), False, [text], _kv_params(b),
    )  # fmt: skip


def check_length(prompt_len: int, max_tokens: int | None, max_model_len: int) -> int:
    """vLLM's context-length check; returns the effective max_tokens."""
    if prompt_len >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of the input "
            "messages.",
        )
    room = max_model_len - prompt_len
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion.",
            "max_tokens",
        )
    return max_tokens
