"""An OpenAI chat request turned into template inputs the way vLLM 0.33 turns it.

vLLM validates the body (pydantic), builds the template keywords from the request fields, the
server defaults and `chat_template_kwargs`, converts each message into the conversation the
template sees (text parts joined with newlines, or kept as typed parts when the template iterates
over content), parses tool-call arguments into objects, and serialises tools with its own field
order. Each step here follows those rules for text-only requests; anything the router cannot
reproduce exactly (images, audio, prompt embeddings, truncation) raises `NotExact`, and
malformed input raises `TokenizeError` (the client gets a 400, as vLLM would answer).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvroute.router.tokenize.content_parts import MEDIA_PART_TYPES, TEXT_FIELDS
from kvroute.router.tokenize.errors import TokenizeError
from kvroute.router.tokenize.spec import TokenizerSpec
from kvroute.router.tokenize.template import ContentFormat


class NotExact(Exception):
    """The router cannot compute the engine's ids for this request (no error for the client).

    `reason` is a short fixed label for metrics."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


_REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})
# Values vLLM treats as "not set" when request fields override keywords.
_UNSET = (None, "auto")
# Parameters of transformers' apply_chat_template: they never reach the template as variables.
_APPLY_PARAMS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
# Keys of the content-part types vLLM knows; the others are kept on text parts in the OpenAI
# content format.
_KNOWN_PART_KEYS = frozenset(
    {
        "audio_embeds",
        "audio_url",
        "closed",
        "data",
        "file",
        "image_embeds",
        "image_pil",
        "image_url",
        "input_audio",
        "name",
        "prompt_cache_breakpoint",
        "refusal",
        "text",
        "thinking",
        "type",
        "uuid",
        "video_embeds",
        "video_url",
    }
)
_BILLING_HEADER = "x-anthropic-billing-header"


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """A validated chat request, before the template is known."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    documents: list[dict[str, Any]] | None
    add_generation_prompt: bool
    continue_final_message: bool
    add_special_tokens: bool
    # Keywords after vLLM's merge (defaults < chat_template_kwargs < request fields), before
    # filtering by the template's variables.
    keywords: dict[str, Any]
    # A template sent by the client (only honoured when the spec trusts request templates).
    request_template: str | None

    def template_kwargs(self, variables: frozenset[str]) -> dict[str, Any]:
        """The keywords the template will see: those it names, minus apply_chat_template's own."""
        return {k: v for k, v in self.keywords.items() if k in variables and k not in _APPLY_PARAMS}


def _merge(
    defaults: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None
) -> dict[str, Any]:
    out = dict(defaults or {})
    for k, v in (overrides or {}).items():
        if v is None or (isinstance(v, str) and v == "auto"):
            continue
        out[k] = v
    return out


def _bool_field(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise TokenizeError(f"`{name}` must be a boolean", param=name)
    return value


def chat_options(body: Mapping[str, Any], spec: TokenizerSpec) -> ChatOptions:
    """Validate a chat completion body and compute vLLM's template keywords.

    Raises TokenizeError for malformed fields, NotExact for requests the router cannot tokenize
    exactly."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise TokenizeError("`messages` must be a list of messages", param="messages")
    if not messages:
        raise TokenizeError("`messages` must not be empty", param="messages")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise TokenizeError(f"messages[{i}] must be an object", param="messages")
        if not isinstance(msg.get("role"), str):
            raise TokenizeError(f"messages[{i}].role must be a string", param="messages")
    if body.get("truncate_prompt_tokens") is not None:
        raise NotExact("truncation")

    add_generation_prompt = _bool_field(body, "add_generation_prompt", True)
    continue_final_message = _bool_field(body, "continue_final_message", False)
    if add_generation_prompt and continue_final_message:
        raise TokenizeError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    add_special_tokens = _bool_field(body, "add_special_tokens", False)

    user_kwargs = body.get("chat_template_kwargs")
    if user_kwargs is None:
        user_kwargs = {}
    if not isinstance(user_kwargs, dict):
        raise TokenizeError(
            "`chat_template_kwargs` must be an object", param="chat_template_kwargs"
        )
    request_template = body.get("chat_template")
    if request_template is None:
        request_template = user_kwargs.get("chat_template")
    if request_template is not None:
        if not spec.trust_request_chat_template:
            raise TokenizeError(
                "Chat template is passed with request, but the server does not trust request "
                "chat templates. Refused request with untrusted chat template.",
                param="chat_template",
            )
        if not isinstance(request_template, str):
            raise TokenizeError("`chat_template` must be a string", param="chat_template")
    if "conversation" in user_kwargs:
        raise TokenizeError(
            "chat_template_kwargs cannot set 'conversation'", param="chat_template_kwargs"
        )
    if user_kwargs.get("sanitize_control_tokens"):
        raise TokenizeError(
            "sanitize_control_tokens is not supported for chat requests",
            param="chat_template_kwargs",
        )

    effort = body.get("reasoning_effort")
    if effort is not None and effort not in _REASONING_EFFORTS:
        raise TokenizeError(
            f"`reasoning_effort` must be one of {sorted(_REASONING_EFFORTS)}",
            param="reasoning_effort",
        )
    documents = _documents(body.get("documents"))
    request_fields: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "documents": documents,
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in user_kwargs:
        request_fields["enable_thinking"] = effort != "none"
    request_kwargs = _merge(user_kwargs, request_fields)

    tools = _tools(body.get("tools"))
    if body.get("tool_choice") == "none" and spec.exclude_tools_when_tool_choice_none:
        tools = None
    defaults = _merge(spec.default_chat_template_kwargs, {"tools": tools, "tokenize": False})
    keywords = _merge(defaults, request_kwargs)
    final_tools = keywords.get("tools")
    final_docs = keywords.get("documents")
    if final_tools is not None and not isinstance(final_tools, list):
        raise TokenizeError("`tools` must be a list", param="tools")
    if final_docs is not None and not isinstance(final_docs, list):
        raise TokenizeError("`documents` must be a list", param="documents")
    if keywords.get("add_generation_prompt") and keywords.get("continue_final_message"):
        raise TokenizeError(
            "continue_final_message and add_generation_prompt are not compatible",
            param="chat_template_kwargs",
        )
    return ChatOptions(
        messages=messages,
        tools=final_tools,
        documents=final_docs,
        add_generation_prompt=bool(keywords.get("add_generation_prompt", False)),
        continue_final_message=bool(keywords.get("continue_final_message", False)),
        add_special_tokens=add_special_tokens,
        keywords=keywords,
        request_template=request_template,
    )


def _documents(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in d.items())
        for d in value
    ):
        raise TokenizeError("`documents` must be a list of objects of strings", param="documents")
    return value


def _opt(value: Any, kind: type, what: str) -> Any:
    if value is not None and (
        not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool)
    ):
        raise TokenizeError(f"`{what}` has the wrong type", param="tools")
    return value


def _tools(value: Any) -> list[dict[str, Any]] | None:
    """Tools as vLLM serialises them for the template (its field order, unset flags dropped)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise TokenizeError("`tools` must be a list", param="tools")
    if not value:
        raise TokenizeError(
            "`tools` must not be an empty array. Either provide at least one tool or omit the "
            "field entirely.",
            param="tools",
        )
    out: list[dict[str, Any]] = []
    for tool in value:
        if not isinstance(tool, dict):
            raise TokenizeError("each tool must be an object", param="tools")
        if tool.get("type", "function") != "function":
            raise TokenizeError("only tools of type 'function' are supported", param="tools")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise TokenizeError("each tool needs `function.name` (a string)", param="tools")
        description = _opt(fn.get("description"), str, "function.description")
        parameters = _opt(fn.get("parameters"), dict, "function.parameters")
        strict = _opt(fn.get("strict"), bool, "function.strict")
        fn_defer = _opt(fn.get("defer_loading"), bool, "function.defer_loading")
        tool_defer = _opt(tool.get("defer_loading"), bool, "defer_loading")
        if tool_defer is not None and fn_defer is None:
            fn_defer = tool_defer
        function: dict[str, Any] = {
            "name": fn["name"],
            "description": description,
            "parameters": parameters,
        }
        if strict is not None:
            function["strict"] = strict
        if fn_defer is not None:
            function["defer_loading"] = fn_defer
        dumped: dict[str, Any] = {"type": "function", "function": function}
        if tool_defer is not None:
            dumped["defer_loading"] = tool_defer
        out.append(dumped)
    return out


# ---- messages -> conversation -------------------------------------------------------------


# Roles of the OpenAI message types. vLLM validates their content parts lazily against a union
# of part types, and whether bare strings or the Responses API part types pass depends on the
# rest of the message (measured: `["a"]` is refused, `["a", {"type": "text", ...}]` accepted).
# The router does not guess: such requests get no ids (custom roles accept them all).
_OPENAI_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_RESPONSES_TEXT_TYPES = frozenset({"input_text", "output_text"})


def _part_text(part: Any, role: str) -> tuple[str, Any]:
    """(kind, value) of one content part: kind "text" (value str or None), "tool_reference"."""
    if role in _OPENAI_ROLES and (
        isinstance(part, str)
        or (isinstance(part, dict) and part.get("type") in _RESPONSES_TEXT_TYPES)
    ):
        raise NotExact("ambiguous_content_part")
    if isinstance(part, str):
        return "text", part
    if not isinstance(part, dict):
        raise TokenizeError("content parts must be strings or objects", param="messages")
    ptype = part.get("type")
    if isinstance(ptype, str) and ptype in TEXT_FIELDS and part.get("uuid") is None:
        value = part.get(TEXT_FIELDS[ptype])
        if value is not None and not isinstance(value, str):
            raise TokenizeError(
                f"the `{TEXT_FIELDS[ptype]}` of a content part must be a string", param="messages"
            )
        return "text", value
    if isinstance(ptype, str) and ptype == "tool_reference" and part.get("uuid") is None:
        return "tool_reference", part.get("name")
    if isinstance(ptype, str) and ptype in MEDIA_PART_TYPES:
        raise NotExact("multimodal")
    if ptype is None or part.get("uuid") is not None:
        if any(k in part for k in MEDIA_PART_TYPES):
            raise NotExact("multimodal")
        if "tool_reference" in part:
            return "tool_reference", part.get("name")
        raise TokenizeError("Missing 'type' field in multimodal part.", param="type")
    if not isinstance(ptype, str):
        raise TokenizeError("Invalid 'type' field in multimodal part.", param="type")
    raise TokenizeError(f"Unsupported chat content part type: {ptype!r}.", param="type")


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    out: list[Any] = []
    for part in parts:
        text: Any
        if isinstance(part, str):
            text = part
        elif isinstance(part, dict) and part.get("type") == "text":
            text = part.get("text")
        else:
            text = None
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _content(role: str, raw: Any, fmt: ContentFormat) -> Any:
    if raw is None:
        parts: list[Any] = []
    elif isinstance(raw, str):
        parts = [{"type": "text", "text": raw}]
    elif isinstance(raw, list):
        parts = raw
    else:
        raise TokenizeError(
            "message content must be a string, a list of parts or null", param="messages"
        )
    if role == "system":
        parts = _strip_billing_header(parts)
    if fmt == "openai":
        wrapped: list[dict[str, Any]] = []
        for part in parts:
            kind, value = _part_text(part, role)
            if value is None:
                continue
            extras = (
                {k: v for k, v in part.items() if k not in _KNOWN_PART_KEYS}
                if isinstance(part, dict)
                else {}
            )
            if kind == "text":
                wrapped.append({"type": "text", "text": value, **extras})
            else:
                wrapped.append({"type": "tool_reference", "name": value})
        return wrapped
    texts: list[str] = []
    for part in parts:
        _, value = _part_text(part, role)
        if value:  # vLLM drops empty strings here (but keeps empty parts in the OpenAI format)
            texts.append(str(value))
    return "\n".join(texts)


def _ordered(d: dict[str, Any], order: tuple[str, ...]) -> dict[str, Any]:
    """`d` with the keys in `order` first (as vLLM's validation lays them out), then the rest."""
    out = {k: d[k] for k in order if k in d}
    out.update((k, v) for k, v in d.items() if k not in out)
    return out


def _tool_calls(calls: Any) -> list[Any] | None:
    """Assistant tool calls as vLLM passes them on: validated like its request model (id,
    type "function", function name and arguments strings), arguments parsed into an object."""
    if not isinstance(calls, list):
        raise TokenizeError("`tool_calls` must be a list", param="tool_calls")
    if not calls:
        return None
    out: list[Any] = []
    for call in calls:
        if not isinstance(call, dict):
            raise TokenizeError("assistant tool_calls entries must be objects.", param="tool_calls")
        fn = call.get("function")
        if call.get("type") != "function" or not isinstance(fn, dict):
            raise TokenizeError(
                "chat completions only support assistant tool_calls of type 'function'.",
                param="tool_calls",
            )
        if not isinstance(call.get("id"), str):
            raise TokenizeError("each tool call needs an `id` string", param="tool_calls")
        if not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise TokenizeError(
                "each tool call needs `function.name` and `function.arguments` strings",
                param="tool_calls",
            )
        fn = _ordered(dict(fn), ("arguments", "name"))
        args = fn["arguments"]
        parsed: Any = None
        if args:
            try:
                parsed = json.loads(args)
            except (ValueError, RecursionError):  # not JSON, a huge integer, deep nesting
                parsed = None
        # vLLM keeps the conversation going with {} when arguments are not a JSON object.
        fn["arguments"] = parsed if isinstance(parsed, dict) else {}
        call = _ordered(dict(call), ("id", "function", "type"))
        call["function"] = fn
        out.append(call)
    return out


def build_conversation(messages: list[dict[str, Any]], fmt: ContentFormat) -> list[dict[str, Any]]:
    """The message list the template sees (vLLM's parse_chat_messages for text content)."""
    conversation: list[dict[str, Any]] = []
    for msg in messages:
        role = msg["role"]
        reasoning = msg.get("reasoning")
        if reasoning is None:
            reasoning = msg.get("reasoning_content")
        if isinstance(reasoning, dict) and reasoning.get("type") == "prompt_embeds":
            raise NotExact("multimodal")
        out: dict[str, Any] = {"role": role, "content": _content(role, msg.get("content"), fmt)}
        if role == "assistant":
            calls = msg.get("tool_calls")
            if calls is not None:
                parsed_calls = _tool_calls(calls)
                if parsed_calls is not None:
                    out["tool_calls"] = parsed_calls
            if reasoning is not None:
                out["reasoning"] = reasoning
                out["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in msg:
                out["tool_call_id"] = msg["tool_call_id"]
            content = out["content"]
            if isinstance(content, list):
                if any(isinstance(p, dict) and p.get("type") != "text" for p in content):
                    pass  # structured parts (tool references) stay for the template
                else:
                    texts = [p.get("text", "") for p in content if isinstance(p, dict)]
                    out["content"] = "\n".join(texts) if texts else ""
        if "name" in msg:
            if not isinstance(msg["name"], str):
                raise TokenizeError("a message `name` must be a string", param="messages")
            out["name"] = msg["name"]
        if isinstance(msg.get("task"), str):
            out["task"] = msg["task"]
        if role == "developer":
            out["tools"] = msg.get("tools")
        conversation.append(out)
    return conversation


def developer_to_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For templates that do not know the developer role: developer messages become system
    messages, and system messages not at the start are merged into one at the start."""
    if not any(m["role"] == "developer" for m in conversation):
        return conversation
    converted: list[dict[str, Any]] = []
    for m in conversation:
        if m["role"] == "developer":
            m = {k: v for k, v in m.items() if k != "tools"}
            m["role"] = "system"
        converted.append(m)
    system_texts: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(converted):
        if m["role"] != "system":
            others.append(m)
            continue
        if i > 0 or system_texts:
            merge = True
        content = m.get("content", "")
        if isinstance(content, list):
            texts: list[str] = []
            for p in content:
                if isinstance(p, dict) and "text" in p:
                    texts.append(str(p["text"]))
                elif isinstance(p, str):
                    texts.append(p)
            content = "\n".join(texts)
        if content:
            system_texts.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(system_texts)}, *others]
