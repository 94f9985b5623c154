"""A `/v1/responses` body as the chat body the local tokenizer renders (vLLM 0.33 renders a
Responses request as that chat conversation; see `kvroute.responses_input`).

What the router cannot reproduce gives no ids (`NotExact`), never wrong ones: a
`previous_response_id` (the history is stored in the engine), `reasoning` (the engine maps
its effort through a table of its own), and function tools (vLLM re-serialises them through
its own schema class before the template sees them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvroute.responses_input import (
    ResponsesInputError,
    chat_messages,
    chat_tools,
    continues_final_message,
)
from kvroute.router.tokenize.chat_request import NotExact
from kvroute.router.tokenize.errors import TokenizeError

# The Responses API's text part types: vLLM's message parser reads them as plain text parts.
_TEXT_PART_TYPES = frozenset({"input_text", "output_text"})
# Responses fields the router cannot reproduce -> the NotExact reason label.
_NOT_EXACT_FIELDS = {
    "previous_response_id": "responses_history",
    "reasoning": "responses_reasoning",
    "prompt": "responses_prompt",
}


def responses_chat_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat-completions body whose rendering is the engine's prompt for this Responses
    body: the same messages, a generation prompt unless the last item is continued, and
    special tokens added (the Responses endpoint tokenizes with them, unlike chat).
    TokenizeError for an input vLLM refuses; NotExact for one the router cannot reproduce."""
    for name, reason in _NOT_EXACT_FIELDS.items():
        if body.get(name) is not None:
            raise NotExact(reason)
    try:
        messages = chat_messages(body)
        tools = chat_tools(body.get("tools"))
    except ResponsesInputError as exc:
        raise TokenizeError(str(exc), param=exc.param) from exc
    if tools is not None:
        raise NotExact("responses_tools")
    if not messages:
        raise TokenizeError("`input` must not be empty", param="input")
    cont = continues_final_message(body.get("input"))
    chat: dict[str, Any] = {
        "messages": [_plain_text_parts(m) for m in messages],
        "add_generation_prompt": not cont,
        "continue_final_message": cont,
        "add_special_tokens": True,
    }
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        chat["chat_template_kwargs"] = kwargs
    return chat


def _plain_text_parts(message: dict[str, Any]) -> dict[str, Any]:
    """The message with Responses text parts as chat `text` parts (vLLM renders both alike;
    the chat renderer cannot tell them apart from the chat endpoint's ambiguous ones)."""
    content = message.get("content")
    if not isinstance(content, list) or not any(
        isinstance(p, dict) and p.get("type") in _TEXT_PART_TYPES for p in content
    ):
        return message
    parts = [
        {"type": "text", "text": p.get("text")}
        if isinstance(p, dict) and p.get("type") in _TEXT_PART_TYPES
        else p
        for p in content
    ]
    return {**message, "content": parts}
