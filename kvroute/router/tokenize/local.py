"""Exact ids in the router: a model directory's tokenizer and chat template, applied as vLLM
applies them, with a per-conversation prefix cache. Synchronous; the service runs it off the
event loop."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from kvroute.router.tokenize.chat_request import (
    NotExact,
    build_conversation,
    chat_options,
    developer_to_system,
)
from kvroute.router.tokenize.encoder import TextEncoder
from kvroute.router.tokenize.errors import TokenizeError
from kvroute.router.tokenize.model_dir import ModelFiles, load_model_dir
from kvroute.router.tokenize.prefix_cache import Lookup, PrefixCache, tenant_seed
from kvroute.router.tokenize.spec import TokenizerSpec
from kvroute.router.tokenize.template import (
    ChatTemplate,
    RenderInput,
    choose_template,
    make_environment,
)

# Encodes pieces of text (without special tokens). The default is the tokenizer's own batch
# encoder in the calling thread (the service's thread pool); a caller may pass another one.
PieceEncoder = Callable[[Sequence[str]], list[list[int]]]

_REQUEST_TEMPLATES_KEPT = 16
# Characters per token until encodes have measured it (English text under byte-level BPE).
_CHARS_PER_TOKEN_START = 4.0
# The next message `remember_answer` renders after an answer: only the text before it is used.
_NEXT_TURN_PLACEHOLDER = "kvroute-next-turn-placeholder"


@dataclass(frozen=True, slots=True)
class EncodeStats:
    """What one encode did: tokens taken from the prefix cache, tokens encoded now."""

    reused_tokens: int
    encoded_tokens: int
    cache_hit: bool


class LocalTokenizer:
    """Renders and tokenizes requests for one model. Thread-safe."""

    def __init__(
        self,
        spec: TokenizerSpec,
        files: ModelFiles,
        *,
        cache: PrefixCache,
        cache_seed: int = 0,
        verify_every: int = 0,
        on_mismatch: Callable[[], None] | None = None,
    ) -> None:
        self.spec = spec
        self.encoder = TextEncoder(files.tokenizer)
        self._special_tokens = dict(files.special_tokens)
        self._env = make_environment()
        self._templates = dict(files.templates)
        self._compiled: dict[str, ChatTemplate] = {}
        # Client-supplied templates (only with trust_request_chat_template), bounded.
        self._request_compiled: OrderedDict[str, ChatTemplate] = OrderedDict()
        self._lock = threading.Lock()
        self.cache = cache
        self._cache_seed = cache_seed
        self._cache_enabled = self.encoder.has_anchors
        self._verify_every = verify_every
        self._verify_count = 0
        self._on_mismatch = on_mismatch
        # measured over every encode (a ratio of sums: long encodes weigh more)
        self._encoded_chars = 0
        self._encoded_tokens = 0
        for source in set(self._templates.values()):
            self._compiled[source] = ChatTemplate(source, self._env)

    @classmethod
    def from_spec(cls, spec: TokenizerSpec, *, cache: PrefixCache, **kw: Any) -> LocalTokenizer:
        if spec.path is None:
            raise ValueError("mode 'local' needs a model directory path")
        return cls(spec, load_model_dir(spec.path, spec.chat_template), cache=cache, **kw)

    @property
    def vocab_size(self) -> int:
        return self.encoder.vocab_size

    @property
    def cache_enabled(self) -> bool:
        return self._cache_enabled

    # ---- templates ------------------------------------------------------------------------

    def _template(self, requested: str | None, has_tools: bool) -> ChatTemplate:
        source = choose_template(self._templates, requested, has_tools)
        if source is None:
            raise NotExact("no_chat_template")
        with self._lock:
            compiled = self._compiled.get(source) or self._request_compiled.get(source)
            if compiled is not None:
                if source in self._request_compiled:
                    self._request_compiled.move_to_end(source)
                return compiled
        try:
            compiled = ChatTemplate(source, self._env)
        except ValueError as exc:
            raise TokenizeError(str(exc), param="chat_template") from exc
        with self._lock:
            self._request_compiled[source] = compiled
            while len(self._request_compiled) > _REQUEST_TEMPLATES_KEPT:
                self._request_compiled.popitem(last=False)
        return compiled

    # ---- public ---------------------------------------------------------------------------

    def render_chat(self, body: Mapping[str, Any]) -> tuple[str, bool]:
        """(prompt text, add_special_tokens) for a chat completion body."""
        opts = chat_options(body, self.spec)
        template = self._template(opts.request_template, opts.tools is not None)
        fmt = (
            template.content_format
            if self.spec.content_format == "auto"
            else self.spec.content_format
        )
        conversation = build_conversation(opts.messages, fmt)
        if not template.knows_developer_role:
            conversation = developer_to_system(conversation)
        text = template.render(
            RenderInput(
                messages=conversation,
                tools=opts.tools,
                documents=opts.documents,
                add_generation_prompt=opts.add_generation_prompt,
                continue_final_message=opts.continue_final_message,
                kwargs=opts.template_kwargs(template.variables),
            ),
            self._special_tokens,
        )
        return text, opts.add_special_tokens

    def chat_ids(
        self, body: Mapping[str, Any], encode: PieceEncoder | None = None
    ) -> tuple[list[int], EncodeStats]:
        text, add_special = self.render_chat(body)
        return self.text_ids(text, add_special, encode, shared_end=first_message_end(text, body))

    def text_ids(
        self,
        text: str,
        add_special_tokens: bool,
        encode: PieceEncoder | None = None,
        lookup: Lookup | None = None,
        shared_end: int | None = None,
        tenant: bytes = b"",
    ) -> tuple[list[int], EncodeStats]:
        """Ids of `text` (from the prefix cache where possible), bounded by the spec.
        `lookup`: `cached_prefix(text)` if the caller already made it (not made again; a hit's
        ids stay right even if its entry was evicted since). `shared_end`: where the text's
        first message ends (`first_message_end`); a text the cache knows nothing of is then
        also remembered through the first cut after it, for other conversations that open
        with the same message. `tenant` (`prefix_cache.tenant_key`): whose entries are used."""
        self.check_length(text)
        enc = encode or self.encoder.encode_pieces
        try:
            ids, stats = (
                self._ids_cached(text, enc, lookup or self.cached_prefix(text, tenant), shared_end)
                if self._cache_enabled
                else self._ids_plain(text, enc)
            )
        except (TypeError, ValueError, UnicodeError, OverflowError) as exc:
            # e.g. lone surrogates in the text: the engine cannot tokenize it either.
            raise NotExact("encode_error") from exc
        if add_special_tokens:
            ids = self.encoder.add_special(ids, text)
        if not ids:
            raise NotExact("empty_prompt")
        if len(ids) > self.spec.max_prompt_tokens:
            raise TokenizeError(
                f"the prompt has {len(ids)} tokens, more than {self.spec.max_prompt_tokens}",
                param="messages",
            )
        return ids, stats

    def remember_answer(self, body: Mapping[str, Any], answer: str, tenant: bytes = b"") -> int:
        """Put the ids of `body`'s conversation followed by the assistant's `answer` into the
        prefix cache, so that the client's next turn (which sends the answer back) encodes
        only its own new message. Returns how many tokens were encoded (0: nothing to do).

        Where the known text ends: the conversation is rendered with a placeholder next
        message; the text before the placeholder does not depend on it, and it is tokenized
        through the prefix cache as any prompt is (`_ids_cached` remembers its last cut, a
        guard region before that point). Exactness does not depend on the guess: a later
        text reuses an entry only if it starts with the same characters (see `prefix_cache`).
        The entries are `tenant`'s (`prefix_cache.tenant_key`)."""
        messages = body.get("messages")
        if not self._cache_enabled or not answer or not isinstance(messages, list):
            return 0
        if body.get("continue_final_message") or body.get("add_generation_prompt") is False:
            return 0
        follow = {
            **body,
            "messages": [
                *messages,
                {"role": "assistant", "content": answer},
                {"role": "user", "content": _NEXT_TURN_PLACEHOLDER},
            ],
        }
        text, _ = self.render_chat(follow)
        known = text.rfind(_NEXT_TURN_PLACEHOLDER)
        if known < 0:
            return 0
        text = text[:known]
        self.check_length(text)
        lookup = self.cached_prefix(text, tenant)
        start = lookup.hit.anchor if lookup.hit is not None else 0
        if self.encoder.cache_anchor(text, start) is None:
            return 0  # the cache already reaches as far as it could
        try:
            _, stats = self._ids_cached(text, self.encoder.encode_pieces, lookup)
        except (TypeError, ValueError, UnicodeError, OverflowError):
            return 0
        return stats.encoded_tokens

    def completion_ids(
        self, body: Mapping[str, Any], encode: PieceEncoder | None = None
    ) -> tuple[list[int], EncodeStats]:
        """Ids for a completions body whose prompt is text (ids prompts are handled earlier)."""
        return self.text_ids(*self.completion_text(body), encode)

    def cached_prefix(self, text: str, tenant: bytes = b"") -> Lookup:
        """The longest start of `text` whose ids the prefix cache knows among `tenant`'s
        entries (one hashing pass over the text; no hit when the cache is off). Pass it on to
        `text_ids`, whose inserts then file under the same tenant."""
        if not self._cache_enabled:
            return Lookup([], None)
        digests = self.cache.digests(text, tenant_seed(self._cache_seed, tenant))
        return Lookup(digests, self.cache.lookup(text, digests))

    @property
    def chars_per_token(self) -> float:
        """Characters per token of the texts encoded so far (a start value until 256 tokens
        have been encoded)."""
        if self._encoded_tokens < 256:
            return _CHARS_PER_TOKEN_START
        return self._encoded_chars / self._encoded_tokens

    def check_length(self, text: str) -> None:
        """TokenizeError for a text too long to be a prompt within the spec's bound."""
        if len(text) > self.spec.max_prompt_tokens * 64:
            raise TokenizeError("the prompt is too long", param="messages")

    def completion_text(self, body: Mapping[str, Any]) -> tuple[str, bool]:
        """(prompt text, add_special_tokens) of a completions body; errors as the engine's."""
        if body.get("prompt_embeds") is not None:
            raise NotExact("prompt_embeds")
        if body.get("suffix") is not None:
            raise NotExact("suffix")
        if body.get("truncate_prompt_tokens") is not None:
            raise NotExact("truncation")
        prompt = body.get("prompt")
        if prompt is None or prompt == "":
            raise TokenizeError(
                "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
            )
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise TokenizeError(
                "`prompt` must be a string, a list of strings or token ids", param="prompt"
            )
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise TokenizeError(
                "`add_special_tokens` must be a boolean", param="add_special_tokens"
            )
        return prompt, add_special

    # ---- encoding -------------------------------------------------------------------------

    def _ids_plain(self, text: str, encode: PieceEncoder) -> tuple[list[int], EncodeStats]:
        ids = encode([text])[0]
        self._measured(len(text), len(ids))
        return ids, EncodeStats(reused_tokens=0, encoded_tokens=len(ids), cache_hit=False)

    def _measured(self, chars: int, tokens: int) -> None:
        # unlocked: a lost update between threads only delays the estimate
        self._encoded_chars += chars
        self._encoded_tokens += tokens

    def _ids_cached(
        self, text: str, encode: PieceEncoder, lookup: Lookup, shared_end: int | None = None
    ) -> tuple[list[int], EncodeStats]:
        digests, hit = lookup.digests, lookup.hit
        start, prefix = (hit.anchor, hit.ids.tolist()) if hit is not None else (0, [])
        guard = self.encoder.guard_chars
        cut = self.encoder.cache_anchor(text, start)
        # A text nothing cached starts: also remember it through its first message, so other
        # conversations that open with the same system prompt reuse its ids instead of
        # encoding it again (their first turns otherwise miss the cache entirely).
        first = (
            self.encoder.first_cache_anchor(text, shared_end - 1)
            if hit is None and shared_end
            else None
        )
        # Checkpoints before the last cut: a later text that departs from this one near its
        # end (an edited last message) still reuses the text before the departure.
        back = self.encoder.checkpoint_anchors(text, start, cut) if cut is not None else []
        cuts = sorted({c for c in (first, cut, *back) if c is not None})
        bounds = [start, *cuts, len(text)]
        encoded = encode([text[a:b] for a, b in pairwise(bounds)])
        reused = len(prefix)
        ids = prefix
        marks: list[tuple[int, int]] = []
        for c, piece in zip(cuts, encoded, strict=False):
            ids.extend(piece)
            marks.append((c, len(ids)))
        if marks:
            self.cache.insert(text, digests, ids, marks, guard)
        ids.extend(encoded[-1])
        new = sum(len(p) for p in encoded)
        self._measured(len(text) - start, new)
        if hit is not None and self._verify_every > 0:
            ids = self._verify(text, ids, encode)
        return ids, EncodeStats(reused_tokens=reused, encoded_tokens=new, cache_hit=hit is not None)

    def _verify(self, text: str, ids: list[int], encode: PieceEncoder) -> list[int]:
        """Every n-th cache hit, tokenize from scratch too; on a difference stop caching for
        this model (and return the from-scratch ids)."""
        with self._lock:
            self._verify_count += 1
            due = self._verify_count % self._verify_every == 0
        if not due:
            return ids
        fresh = encode([text])[0]
        if fresh != ids:
            self._cache_enabled = False
            self.cache.clear()
            if self._on_mismatch is not None:
                self._on_mismatch()
        return fresh


def first_message_end(text: str, body: Mapping[str, Any]) -> int | None:
    """Where the first message's text content ends in a rendered chat prompt (None when the
    first message has no plain text content or the template did not copy it verbatim)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[0], dict):
        return None
    content = messages[0].get("content")
    if not isinstance(content, str):
        return None
    content = content.strip()  # templates often trim a message
    at = text.find(content) if content else -1
    return at + len(content) if at >= 0 else None
