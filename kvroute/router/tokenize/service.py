"""`Tokenizers`: the router's one entry point for exact token ids (see the package docstring)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from kvroute.ratelog import RateLimitedLog
from kvroute.router.tokenize.chat_request import NotExact
from kvroute.router.tokenize.errors import TokenizeError
from kvroute.router.tokenize.local import EncodeStats, LocalTokenizer, first_message_end
from kvroute.router.tokenize.metrics import TokenizeMetrics
from kvroute.router.tokenize.prefix_cache import Lookup, PrefixCache
from kvroute.router.tokenize.render_client import AiohttpPoster, JsonPoster, RenderClient
from kvroute.router.tokenize.request_ids import IdsValidator, engine_ids, hinted_ids
from kvroute.router.tokenize.responses_request import responses_chat_body
from kvroute.router.tokenize.spec import PendingText, TokenizedPrompt, TokenizerSpec

log = logging.getLogger("kvroute.tokenize")

_DEFAULT_KEY = "_default"
_RELOAD_AFTER_S = 60.0
# answers waiting for (or in) their thread; more are dropped (the next turn then encodes the
# answer itself, as without the feature)
_ANSWERS_WAITING = 8
T = TypeVar("T")
# the worker whose render endpoint to ask: a URL, or a function giving it on demand
RenderUrl = str | Callable[[], str | None] | None


@dataclass(slots=True)
class _LoadFailure:
    at: float
    error: str


class Tokenizers:
    """Exact token ids per model: locally, from the engine's render endpoint, or from the
    request. Cheap to construct (no I/O); local tokenizers load in `start()` or on first use,
    off the event loop. Safe to call concurrently."""

    def __init__(
        self,
        specs: Mapping[str, TokenizerSpec],
        *,
        default: TokenizerSpec | None = None,
        threads: int = 2,
        cache_entries: int = 4096,
        cache_bytes: int = 256 << 20,
        render_timeout_s: float = 5.0,
        registry: CollectorRegistry | None = None,
        http: JsonPoster | None = None,
        verify_every: int = 1000,
        inline_chars: int = 4096,
    ) -> None:
        if threads < 1:
            raise ValueError("threads must be >= 1")
        self._specs = dict(specs)
        self._default = default
        self._threads = threads
        self._executor: ThreadPoolExecutor | None = None
        self._cache = PrefixCache(max_entries=cache_entries, max_bytes=cache_bytes)
        self._metrics = TokenizeMetrics(registry)
        self._metrics.watch_cache(self._cache.stats)
        self._own_poster = AiohttpPoster() if http is None else None
        self._render = RenderClient(http or self._own_poster or AiohttpPoster(), render_timeout_s)
        self._verify_every = verify_every
        self._inline_chars = inline_chars
        self._local: dict[str, LocalTokenizer | _LoadFailure] = {}
        self._load_locks: dict[str, asyncio.Lock] = {}
        self._validators: dict[str, IdsValidator] = {}
        self._seeds = {key: i + 1 for i, key in enumerate([*self._specs, _DEFAULT_KEY])}
        self._log = RateLimitedLog(log)
        self._answer_tasks: set[asyncio.Task[None]] = set()
        # answers are encoded on a thread of their own: a request's encode, which it waits
        # for, never queues behind them in the pool
        self._answer_executor: ThreadPoolExecutor | None = None

    # ---- lifecycle ------------------------------------------------------------------------

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                self._threads, thread_name_prefix="kvroute-tokenize"
            )
        return self._executor

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool(), partial(fn, *args))

    async def start(self) -> None:
        """Load every local tokenizer now (failures are logged; those models get no ids)."""
        keys = [(k, s) for k, s in self._specs.items() if s.mode == "local"]
        if self._default is not None and self._default.mode == "local":
            keys.append((_DEFAULT_KEY, self._default))
        await asyncio.gather(*(self._local_for(k, s) for k, s in keys))

    async def aclose(self) -> None:
        for task in list(self._answer_tasks):
            task.cancel()
        if self._answer_executor is not None:
            self._answer_executor.shutdown(wait=False, cancel_futures=True)
            self._answer_executor = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        if self._own_poster is not None:
            await self._own_poster.aclose()

    # ---- the call -------------------------------------------------------------------------

    async def token_ids(
        self,
        model: str,
        endpoint: str,
        body: dict[str, Any],
        worker_url_for_render: RenderUrl,
        *,
        partial_min_chars: int = 0,
        tenant: bytes = b"",
    ) -> TokenizedPrompt | None:
        """The ids the engine will prefill for this request, or None when they cannot be known
        (the router then routes without cache evidence). Raises TokenizeError when the request
        is malformed (the router answers 400). Never mutates `body`.

        With `partial_min_chars` > 0, a locally tokenized prompt whose start is in the prefix
        cache and whose rest is at least that many characters comes back partial: the exact
        ids of the start, and `pending` for `finish` (so a multi-turn request can be routed
        before its new turn is encoded).

        `tenant` (`prefix_cache.tenant_key` of the request's LoRA name and cache_salt) selects
        the prefix-cache entries the request may use and add to: never another tenant's."""
        key = self._key(model)
        spec = self._specs.get(model, self._default)
        if spec is None:
            self._unavailable(key, "no_spec")
            return None
        started = time.perf_counter()
        try:
            result = await self._token_ids(
                key, spec, endpoint, body, worker_url_for_render, partial_min_chars, tenant
            )
        except TokenizeError as exc:
            self._metrics.results.labels(key, "client_error").inc()
            self._log.warning(
                f"client:{key}:{exc.param}",
                "model %s: refused a request (%s): %s",
                key,
                exc.param,
                exc,
            )
            raise
        except NotExact as exc:
            self._unavailable(key, exc.reason)
            return None
        m = self._metrics
        m.child(m.seconds, spec.mode).observe(time.perf_counter() - started)
        m.child(m.results, key, result.source).inc()
        return result

    def _key(self, model: str) -> str:
        """The key of a model's tokenizer (its own, else the default's)."""
        return model if model in self._specs else _DEFAULT_KEY

    def _unavailable(self, key: str, reason: str) -> None:
        self._metrics.results.labels(key, "unavailable").inc()
        self._metrics.unavailable.labels(key, reason).inc()

    async def _token_ids(
        self,
        key: str,
        spec: TokenizerSpec,
        endpoint: str,
        body: Mapping[str, Any],
        worker_url: RenderUrl,
        partial_min_chars: int = 0,
        tenant: bytes = b"",
    ) -> TokenizedPrompt:
        local = await self._local_for(key, spec) if spec.mode == "local" else None
        vocab = local.vocab_size if local is not None else spec.vocab_size
        carried = engine_ids(endpoint, body)
        if carried is None and spec.mode == "request":
            carried = hinted_ids(endpoint, body)
        if carried is not None:
            check = self._validators.get(key)
            if check is None or check.vocab_size != vocab:
                check = self._validators[key] = IdsValidator(vocab, spec.max_prompt_tokens)
            return TokenizedPrompt(check(carried[0], carried[1]), "request")
        if spec.mode == "request":
            raise NotExact("no_ids_in_request")
        if spec.mode == "render":
            if callable(worker_url):  # chosen only when needed: it costs a fleet scan
                worker_url = worker_url()
            if worker_url is None:
                raise NotExact("no_worker")
            res = await self._render.ids(endpoint, body, worker_url)
            if res.ids is None:
                self._log.warning(
                    f"render:{key}:{res.reason}",
                    "no ids from %s for model %s: %s",
                    worker_url,
                    key,
                    res.reason,
                )
                raise NotExact(f"render_{res.reason}")
            return TokenizedPrompt(res.ids, "render")
        if local is None:
            raise NotExact("load_failed")
        # Rendering and the prefix-cache look-up are cheap; encoding what the cache lacks
        # runs here when it is small (a multi-turn request adds one turn) and in the pool
        # when it would stall the loop. The hop costs more than a short encode.
        text, add_special = self._local_text(local, endpoint, body)
        lookup = local.cached_prefix(text, tenant)
        hit = lookup.hit
        # add_special_tokens may append tokens at the end: only whole prompts then
        if hit is not None and not add_special:
            uncached = lookup.uncached_chars(text)
            if 0 < partial_min_chars <= uncached:
                local.check_length(text)
                estimate = len(hit.ids) + math.ceil(uncached / local.chars_per_token)
                pending = PendingText(key, text, lookup, estimate)
                return TokenizedPrompt(hit.ids, "local", pending)
        # only a text the cache knows nothing of gets the first-message entry (`text_ids`)
        shared_end = (
            first_message_end(text, body)
            if hit is None and endpoint == "/v1/chat/completions"
            else None
        )
        return await self._encode(key, local, text, add_special, lookup, shared_end)

    async def _encode(
        self,
        key: str,
        local: LocalTokenizer,
        text: str,
        add_special: bool,
        lookup: Lookup,
        shared_end: int | None = None,
    ) -> TokenizedPrompt:
        encode = partial(local.text_ids, text, add_special, lookup=lookup, shared_end=shared_end)
        if lookup.uncached_chars(text) <= self._inline_chars:
            ids, stats = encode()
        else:
            ids, stats = await self._run(encode)
        self._count(key, stats)
        return TokenizedPrompt(ids, "local")

    def remember_answer(
        self,
        model: str,
        body: Mapping[str, Any],
        answer_of: Callable[[], str | None],
        tenant: bytes = b"",
    ) -> bool:
        """Encode, in the background, `body`'s conversation with the assistant's answer
        (`answer_of()`, called there too: taking the text out of a relayed stream is work the
        event loop need not do) into the prefix cache (`LocalTokenizer.remember_answer`), so
        the next turn's encode, which is on the request's critical path, covers only its new
        message. Returns False when it is not done: no local tokenizer for the model, or too
        many answers waiting (`_ANSWERS_WAITING`; they have one thread of their own, apart
        from the pool that requests wait for). The entries are `tenant`'s, as in `token_ids`."""
        key = self._key(model)
        local = self._local.get(key)
        if not isinstance(local, LocalTokenizer) or not local.cache_enabled:
            return False
        if len(self._answer_tasks) >= _ANSWERS_WAITING:
            self._metrics.child(self._metrics.answers, key, "busy").inc()
            return False
        task = asyncio.get_running_loop().create_task(
            self._remember(key, local, body, answer_of, tenant)
        )
        self._answer_tasks.add(task)
        task.add_done_callback(self._answer_tasks.discard)
        return True

    async def _remember(
        self,
        key: str,
        local: LocalTokenizer,
        body: Mapping[str, Any],
        answer_of: Callable[[], str | None],
        tenant: bytes,
    ) -> None:
        m = self._metrics
        if self._answer_executor is None:
            self._answer_executor = ThreadPoolExecutor(1, thread_name_prefix="kvroute-answers")
        loop = asyncio.get_running_loop()
        try:
            encoded = await loop.run_in_executor(
                self._answer_executor, partial(_remember_answer, local, body, answer_of, tenant)
            )
        except Exception as exc:  # a cache warmer must never fail anything; counted, logged
            m.child(m.answers, key, "error").inc()
            self._log.warning(f"answer:{key}", "model %s: caching an answer failed: %s", key, exc)
            return
        m.child(m.answers, key, "remembered" if encoded else "nothing_new").inc()
        if encoded:
            m.child(m.tokens, key, "answer").inc(encoded)

    async def finish(self, partial: TokenizedPrompt) -> TokenizedPrompt | None:
        """The whole prompt of a partial `token_ids` answer (itself if it is whole), or None
        when the rest cannot be encoded (logged and counted; the engine will answer the
        request as it sees fit, so nothing is raised)."""
        pending = partial.pending
        if pending is None:
            return partial
        local = self._local.get(pending.model_key)
        if not isinstance(local, LocalTokenizer):
            return None
        started = time.perf_counter()
        try:
            whole = await self._encode(
                pending.model_key, local, pending.text, False, pending.lookup
            )
        except (TokenizeError, NotExact) as exc:
            reason = getattr(exc, "reason", None) or getattr(exc, "param", None) or "error"
            self._unavailable(pending.model_key, f"rest_{reason}")
            self._log.warning(
                f"rest:{pending.model_key}",
                "model %s: the rest of a partially tokenized prompt failed: %s",
                pending.model_key,
                exc,
            )
            return None
        self._metrics.child(self._metrics.seconds, "local_rest").observe(
            time.perf_counter() - started
        )
        return whole

    @staticmethod
    def _local_text(
        local: LocalTokenizer, endpoint: str, body: Mapping[str, Any]
    ) -> tuple[str, bool]:
        """(text to encode, add_special_tokens) for a request the local tokenizer serves."""
        if endpoint == "/v1/chat/completions":
            return local.render_chat(body)
        if endpoint == "/v1/completions":
            return local.completion_text(body)
        if endpoint == "/v1/responses":
            return local.render_chat(responses_chat_body(body))
        if endpoint == "/v1/embeddings":
            text = body.get("input")
            if isinstance(text, list) and text and isinstance(text[0], str):
                text = text[0]
            if not isinstance(text, str) or body.get("truncate_prompt_tokens") is not None:
                raise NotExact("embeddings_input")
            add_special = body.get("add_special_tokens", True)
            if not isinstance(add_special, bool):
                raise TokenizeError(
                    "`add_special_tokens` must be a boolean", param="add_special_tokens"
                )
            return text, add_special
        raise NotExact("endpoint_not_local")

    def _count(self, key: str, stats: EncodeStats) -> None:
        self._metrics.lookups.labels("hit" if stats.cache_hit else "miss").inc()
        if stats.reused_tokens:
            self._metrics.tokens.labels(key, "reused").inc(stats.reused_tokens)
        self._metrics.tokens.labels(key, "encoded").inc(stats.encoded_tokens)

    # ---- local tokenizers -----------------------------------------------------------------

    async def _local_for(self, key: str, spec: TokenizerSpec) -> LocalTokenizer | None:
        found = self._local.get(key)
        if isinstance(found, LocalTokenizer):
            return found
        if isinstance(found, _LoadFailure) and time.monotonic() - found.at < _RELOAD_AFTER_S:
            return None
        lock = self._load_locks.setdefault(key, asyncio.Lock())
        async with lock:
            found = self._local.get(key)
            if isinstance(found, LocalTokenizer):
                return found
            if isinstance(found, _LoadFailure) and time.monotonic() - found.at < _RELOAD_AFTER_S:
                return None
            try:
                loaded: LocalTokenizer = await self._run(
                    partial(
                        LocalTokenizer.from_spec,
                        spec,
                        cache=self._cache,
                        cache_seed=self._seeds.get(key, 0),
                        verify_every=self._verify_every,
                        on_mismatch=partial(self._on_mismatch, key),
                    )
                )
            except Exception as exc:  # a broken model directory must not take the router down
                self._local[key] = _LoadFailure(time.monotonic(), str(exc))
                self._metrics.load_failures.labels(key).inc()
                log.error("cannot load the tokenizer for model %s from %s: %s", key, spec.path, exc)
                return None
            self._local[key] = loaded
            if not loaded.cache_enabled:
                log.info("model %s: no cut points, prefix cache off (full tokenization)", key)
            refusal = loaded.encoder.pretok_refusal
            if refusal is not None:
                log.info(
                    "model %s: plain text between added tokens is encoded whole (%s)", key, refusal
                )
            return loaded

    def _on_mismatch(self, key: str) -> None:
        self._metrics.mismatches.labels(key).inc()
        log.error(
            "model %s: prefix-cached ids differed from a full tokenization; prefix cache "
            "disabled for this model (please report the model's tokenizer)",
            key,
        )


def _remember_answer(
    local: LocalTokenizer,
    body: Mapping[str, Any],
    answer_of: Callable[[], str | None],
    tenant: bytes,
) -> int:
    """On the answer thread: the answer's text, then its ids into the cache (tokens encoded)."""
    answer = answer_of()
    return local.remember_answer(body, answer, tenant) if answer else 0
