"""A `/v1/responses` request's `instructions` and `input` as the chat messages vLLM 0.33
renders with the chat template (no Harmony models).

vLLM turns a Responses request into a chat conversation before it renders the prompt:
`instructions` become a system message, a string `input` a user message, and each input item
a message (assistant text, assistant tool calls, tool results; other roles as given). Both
the simulated engine (to prefill what vLLM would) and the router's local tokenizer (to know
those ids before routing) use this module, and the conformance tests hold it to vLLM's own
functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_PARTIAL = frozenset({"in_progress", "incomplete"})
# Item types that end a generation the client wants continued (vLLM continues the final
# message of these when its status says it was cut short).
_CONTINUABLE = frozenset({"message", "reasoning"})


class ResponsesInputError(ValueError):
    """An input vLLM refuses (400); `param` names the request field."""

    def __init__(self, message: str, param: str = "input") -> None:
        super().__init__(message)
        self.param = param


def chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conversation vLLM renders for a Responses body (without earlier responses'
    history: `previous_response_id` is resolved by the engine). ResponsesInputError for an
    input vLLM refuses."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ResponsesInputError("instructions must be a string", "instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    value = body.get("input")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
        return messages
    if not isinstance(value, list):
        raise ResponsesInputError("input must be a string or a list of items")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ResponsesInputError(f"input[{i}] must be an object")
        message = _message_of(item, messages[-1] if messages else None, i)
        if message is not None:
            messages.append(message)
    return messages


def continues_final_message(value: Any) -> bool:
    """Whether vLLM continues the last input item instead of opening a new assistant turn:
    a message or reasoning item whose status says it was cut short."""
    if not isinstance(value, list) or not value or not isinstance(value[-1], dict):
        return False
    last = value[-1]
    return last.get("type", "message") in _CONTINUABLE and last.get("status") in _PARTIAL


def _message_of(item: dict[str, Any], prev: dict[str, Any] | None, i: int) -> dict[str, Any] | None:
    """The message for one input item, or None when it was merged into `prev` (vLLM folds
    consecutive assistant parts, e.g. text then tool calls, into one assistant message)."""
    kind = item.get("type")
    handler = _BY_TYPE.get(kind) if isinstance(kind, str) else None
    if handler is not None:
        return handler(item, _assistant(prev), i)
    role = item.get("role")
    if kind not in (None, "message") or not isinstance(role, str):
        raise ResponsesInputError(f"Unsupported input item type: {kind}")
    if role == "assistant":
        return _assistant_text(item, _assistant(prev), i)
    return item


def _assistant(prev: dict[str, Any] | None) -> dict[str, Any] | None:
    return prev if prev is not None and prev.get("role") == "assistant" else None


def _assistant_text(
    item: dict[str, Any], prev: dict[str, Any] | None, i: int
) -> dict[str, Any] | None:
    content = item.get("content")
    if isinstance(content, str):
        text: Any = content
    elif isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
    else:
        raise ResponsesInputError(f"input[{i}].content must be a string or a list of parts")
    if not isinstance(text, str):
        raise ResponsesInputError(f"input[{i}].content[0].text must be a string")
    if prev is not None and prev.get("content") is None:
        prev["content"] = text
        return None
    return {"role": "assistant", "content": text}


def _function_call(
    item: dict[str, Any], prev: dict[str, Any] | None, i: int
) -> dict[str, Any] | None:
    name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
    if not all(isinstance(v, str) for v in (name, arguments, call_id)):
        raise ResponsesInputError(f"input[{i}]: a function_call needs name, arguments, call_id")
    namespace = item.get("namespace")
    if isinstance(namespace, str) and namespace:
        name = f"{namespace}.{name}"
    call = {"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}
    if prev is not None:
        calls = prev.get("tool_calls")
        if calls is None:
            prev["tool_calls"] = [call]
            return None
        if isinstance(calls, list):
            calls.append(call)
            return None
    return {"role": "assistant", "tool_calls": [call]}


def _tool_output(item: dict[str, Any], _: dict[str, Any] | None, i: int) -> dict[str, Any]:
    return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}


def _reasoning(item: dict[str, Any], prev: dict[str, Any] | None, i: int) -> dict[str, Any] | None:
    if item.get("encrypted_content"):
        raise ResponsesInputError("Encrypted content is not supported.")
    text = ""
    content, summary = item.get("content"), item.get("summary")
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text") or ""
    elif isinstance(summary, list) and summary and isinstance(summary[0], dict):
        text = summary[0].get("text") or ""
    if prev is not None and prev.get("reasoning") is None:
        prev["reasoning"] = text
        return None
    return {"role": "assistant", "reasoning": text}


_BY_TYPE = {
    "function_call": _function_call,
    "function_call_output": _tool_output,
    "custom_tool_call_output": _tool_output,
    "reasoning": _reasoning,
}


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Flat Responses function tools as chat-completions tools (other tool kinds are the
    engine's built-ins and do not reach the template); None without function tools."""
    if tools is None:
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, str):
        raise ResponsesInputError("tools must be a list", "tools")
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            continue
        function = {k: v for k, v in tool.items() if k != "type"}
        out.append({"type": "function", "function": function})
    return out or None
