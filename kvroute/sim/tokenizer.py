"""The engine's tokenizer: a local Hugging Face model directory, used the way vLLM uses it.

- Completions: `encode(prompt)` adds special tokens (BOS via the tokenizer's post-processor).
- Chat: the messages are normalised as vLLM does (text parts joined with newlines, tool-call
  arguments parsed into objects), rendered with the directory's Jinja chat template in a
  sandbox with Hugging Face's helpers (`tojson`, `raise_exception`), then encoded WITHOUT
  adding special tokens (the template writes BOS itself).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from kvroute.sim.model import MODEL_DIR


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (bad roles, template raised, malformed content)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # Hugging Face's filter: plain json.dumps, no HTML escaping, keys in given order.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _text_of(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type") in ("text", "input_text"):
                texts.append(str(part.get("text", "")))
            else:
                raise ChatTemplateError(f"{param}: only text content parts are supported")
        return "\n".join(texts)
    raise ChatTemplateError(f"{param}: content must be a string or a list of parts")


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """vLLM-style conversation: string contents, tool-call arguments as objects."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ChatTemplateError(f"messages[{i}] must be an object with a role")
        msg: dict[str, Any] = dict(message)
        msg["content"] = _text_of(message.get("content"), f"messages[{i}].content")
        calls = msg.get("tool_calls")
        if msg["role"] == "assistant" and isinstance(calls, list):
            if not calls:
                msg.pop("tool_calls")
            else:
                msg["tool_calls"] = [_normalize_call(call, i) for call in calls]
        out.append(msg)
    return out


def _normalize_call(call: Any, i: int) -> dict[str, Any]:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise ChatTemplateError(f"messages[{i}].tool_calls entries must be function objects")
    fn = dict(call["function"])
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args else {}
        except json.JSONDecodeError:
            args = {}
    fn["arguments"] = args if isinstance(args, dict) else {}
    return {**call, "function": fn}


class SimTokenizer:
    """Tokenizer + chat template of a local model directory."""

    def __init__(self, model_dir: Path | str = MODEL_DIR) -> None:
        self.model_dir = Path(model_dir)
        self._tok = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        config = json.loads((self.model_dir / "tokenizer_config.json").read_text("utf-8"))
        self.bos_token: str = config.get("bos_token") or ""
        self.eos_token: str = config.get("eos_token") or ""
        template = config.get("chat_template")
        if template is None and (self.model_dir / "chat_template.jinja").exists():
            template = (self.model_dir / "chat_template.jinja").read_text("utf-8")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        self._template = env.from_string(template) if template else None
        # vLLM hands a template that never names the developer role system messages instead.
        self._knows_developer = bool(template) and "developer" in str(template)
        eos_id = self._tok.token_to_id(self.eos_token)
        if eos_id is None:
            raise ValueError(f"{self.model_dir}: eos_token {self.eos_token!r} is not in the vocab")
        self.eos_token_id: int = eos_id
        end_turn = self._tok.token_to_id("<|im_end|>")
        # Generation stops at EOS or at the end-of-turn marker (like a chat model's
        # generation_config eos_token_id list).
        self.stop_token_ids: frozenset[int] = frozenset(
            t for t in (eos_id, end_turn) if t is not None
        )
        self.special_ids: frozenset[int] = frozenset(self._tok.get_added_tokens_decoder().keys())

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def render_chat(
        self,
        messages: Sequence[Any],
        *,
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text vLLM's chat endpoint would build for these messages.

        continue_final_message (as Hugging Face does it): render without a generation prompt
        and cut the text right after the final message's content, so the model continues it.
        """
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )
        if self._template is None:
            raise ChatTemplateError("the model directory has no chat template")
        kwargs = dict(chat_template_kwargs or {})
        conversation = normalize_messages(messages)
        if not self._knows_developer:
            # (vLLM also merges system messages that do not lead the conversation into the
            # first one; the simulated engine's prompts open with theirs.)
            conversation = [
                {**m, "role": "system"} if m["role"] == "developer" else m for m in conversation
            ]
        kwargs.update(
            messages=conversation,
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        try:
            text = str(self._template.render(**kwargs))
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, KeyError) as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        if continue_final_message:
            final = kwargs["messages"][-1]["content"].strip()
            cut = text.rfind(final) if final else -1
            if cut < 0:
                raise ChatTemplateError("the final message is not in the rendered chat")
            text = text[: cut + len(final)]
        return text

    def chat_ids(self, messages: Sequence[Any], **kwargs: Any) -> list[int]:
        """Token ids of the rendered chat prompt (no extra special tokens added)."""
        return self.encode(self.render_chat(messages, **kwargs), add_special_tokens=False)
