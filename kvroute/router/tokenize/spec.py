"""Records: how to get exact ids for one model, and the ids the router got."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvroute.router.tokenize.prefix_cache import Lookup

Mode = Literal["local", "render", "request"]
ContentFormat = Literal["auto", "string", "openai"]


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """How to get exact token ids for one model (from the router config `models:` section).

    mode "local": tokenize in the router from a model directory (`path`: tokenizer.json,
    tokenizer_config.json with a chat template, or a chat_template.jinja file).
    mode "render": ask a worker (vLLM's `/v1/chat/completions/render`, `/v1/completions/render`).
    mode "request": use ids the client sent (completions `prompt` as ids, or `prompt_token_ids`).

    The remaining fields mirror the vLLM server flags that change the prompt, so that a local
    tokenizer renders what the engine renders; set them as the engine is started.
    """

    mode: Mode
    path: str | None = None
    # Path of a .jinja file overriding the directory's template (vLLM's --chat-template).
    chat_template: str | None = None
    # vLLM's --chat-template-content-format ("auto" detects it from the template).
    content_format: ContentFormat = "auto"
    # vLLM's --default-chat-template-kwargs.
    default_chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # vLLM's --trust-request-chat-template: without it a request carrying its own template is
    # refused by the engine, so the router refuses it too (400) and never renders client Jinja.
    trust_request_chat_template: bool = False
    # vLLM's --exclude-tools-when-tool-choice-none.
    exclude_tools_when_tool_choice_none: bool = False
    # Largest prompt (in tokens) accepted from a client in mode "request" and the bound on
    # rendered prompts in mode "local" (longer inputs are refused with a 400).
    max_prompt_tokens: int = 1 << 20
    # Vocabulary size for validating client ids in mode "request" (None: only non-negative);
    # in mode "local" the tokenizer's own size is used.
    vocab_size: int | None = None


@dataclass(frozen=True, slots=True)
class PendingText:
    """The part of a prompt not tokenized yet (never one with special tokens to add):
    `Tokenizers.finish` encodes it."""

    model_key: str
    text: str  # the whole prompt text
    lookup: Lookup  # its prefix-cache look-up (the start that is known)
    estimated_tokens: int  # of the whole prompt: the known ids + the rest at chars per token


@dataclass(frozen=True, slots=True)
class TokenizedPrompt:
    """The ids the engine will prefill for a request and where they came from.

    With `pending` set, `token_ids` are only the exact ids of the prompt's start (a
    conversation's history, from the prefix cache); `Tokenizers.finish` gives the whole."""

    token_ids: Sequence[int]  # a list, or the prefix cache's array("I") for a partial one
    source: str  # "local" | "render" | "request"
    pending: PendingText | None = None
