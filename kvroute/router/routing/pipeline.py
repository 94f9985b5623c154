"""From a parsed request to a routing decision: token ids, predicted reuse, policy.

`Routing` owns the steps between the edge and the proxy: resolve the model, get exact token
ids, score every worker once, let the policy choose among the eligible ones, record the
decision, and after a successful dispatch record the prompt as an expectation on the chosen
worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvroute.ratelog import RateLimitedLog
from kvroute.router.config import ModelSpec, PdConfig, PolicyConfig
from kvroute.router.edge.errors import NO_WORKER, TOKENIZE, UNKNOWN_MODEL, RouterError
from kvroute.router.edge.openai_request import CHAT, ClientRequest, skips_prefix_cache
from kvroute.router.fleet.workers import BOTH, DECODE, PREFILL, ModelRoute, Worker, WorkerRegistry
from kvroute.router.ops.metrics import RouterMetrics
from kvroute.router.routing.decode_choice import DecodeChoice, choose_decode
from kvroute.router.routing.index_view import IndexView, TierReuse
from kvroute.router.routing.link_rate import LinkRate
from kvroute.router.routing.policy import (
    FULL_ATTENTION_ONLY,
    REACH,
    Decision,
    Policy,
    RouteInput,
    session_key,
)
from kvroute.router.routing.prefix_sharing import PrefixSharing
from kvroute.router.routing.records import PlacementInput
from kvroute.router.routing.working_set import WorkingSet
from kvroute.router.tokenize.prefix_cache import tenant_key

log = logging.getLogger("kvroute.router.routing")

_EMPTY: Mapping[str, int | None] = {}
_Scores = Mapping[str, int | None]
BYTES_PER_TOKEN_ESTIMATE = 4


class PendingLike(Protocol):
    @property
    def estimated_tokens(self) -> int: ...


class TokenizedLike(Protocol):
    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def source(self) -> str: ...
    @property
    def pending(self) -> PendingLike | None: ...


class TokenizerLike(Protocol):
    async def token_ids(
        self,
        model: str,
        endpoint: str,
        body: dict[str, Any],
        worker_url_for_render: str | Callable[[], str | None] | None,
        *,
        partial_min_chars: int = 0,
        tenant: bytes = b"",
    ) -> TokenizedLike | None: ...

    async def finish(self, partial: Any) -> TokenizedLike | None: ...

    def remember_answer(
        self,
        model: str,
        body: Mapping[str, Any],
        answer_of: Callable[[], str | None],
        tenant: bytes = b"",
    ) -> bool: ...


@dataclass(frozen=True, slots=True)
class AnswerTarget:
    """Whose prefix-cache entries a chat answer goes to: the base model's tokenizer, under
    the request's tenant (`prefix_cache.tenant_key`)."""

    model: str
    tenant: bytes


@dataclass(slots=True)
class Prompt:
    """A request's prompt as the router knows it."""

    token_ids: Sequence[int] | None  # a partial prompt's may be the tokenizer cache's array
    source: str  # local | render | request | none
    n_tokens: int  # exact when token_ids is set, else estimated from the body size
    lora_name: str
    cache_salt: str
    cacheable: bool = True  # False: vLLM will not read the prefix cache for it
    keys: Sequence[int] | None = None  # the index's keys for it, computed once (`Routing.keys`)
    # full-attention coverage of hybrid workers, found while scoring (`Routing.reuse`)
    coverage: Mapping[str, int] | None = None
    # tokens each worker's lower tiers add beyond its reuse, found while scoring
    tiers: Mapping[str, TierReuse] | None = None
    # set while token_ids are only the prompt's start (`Routing.complete` encodes the rest);
    # n_tokens is then an estimate
    partial: TokenizedLike | None = None
    # seconds `Routing.reuse` last spent scoring it; `Routing.decide` counts them in
    scoring_s: float = 0.0


class Routing:
    def __init__(
        self,
        registry: WorkerRegistry,
        index: IndexView,
        policy: Policy,
        cfg: PolicyConfig,
        models: Mapping[str, ModelSpec],
        tokenizers: TokenizerLike,
        metrics: RouterMetrics,
        unusable: Callable[[], Collection[str]] = frozenset,
        clock: Callable[[], float] = time.monotonic,
        retry_after_s: int = 1,
        partial_min_chars: int = 0,
        pd: PdConfig | None = None,
    ) -> None:
        self._pd = pd or PdConfig()
        self.link_rate = LinkRate(self._pd.link_gbps * 1e9 / 8, learn=self._pd.learn_link)
        self._decode_turn = 0
        self._retry_after = retry_after_s
        self._partial_min_chars = partial_min_chars
        self._ratelog = RateLimitedLog(log, interval_s=10.0)
        self.registry = registry
        self.index = index
        self.policy = policy
        self.cfg = cfg
        self._models = models
        self._tokenizers = tokenizers
        self._metrics = metrics
        self._unusable = unusable
        self._clock = clock
        # the index view the policy declares: hybrid-correct reuse with coverage, or
        # full-attention-only reuse (KeyError at startup for a view nobody implements)
        self._score: Callable[[Prompt, Sequence[int] | None], _Scores] = {
            REACH: self._reach,
            FULL_ATTENTION_ONLY: self._full_attention_only,
        }[policy.index_view]
        self._decision_hist = metrics.decision_seconds
        self._decision_count = metrics.decisions
        # who asked for which prefix, for the junction credit (only the TTFT policy uses it)
        self._sharing = (
            PrefixSharing(cfg.hash_unit, cfg.sharing_max_keys)
            if cfg.junction_shared_only and cfg.affinity_weight > 0 and policy.needs_reuse
            else None
        )

        # the conversations expected back on each worker (shown always; priced by the
        # placement term when policy.placement_weight > 0)
        self.working_set = WorkingSet(
            cfg.working_set_max_conversations, cfg.working_set_idle_s, cfg.return_interval_s
        )

    @property
    def remembered_prompt_keys(self) -> int:
        """How many prompt keys the router remembers for the junction credit (0 when off)."""
        return 0 if self._sharing is None else len(self._sharing)

    @property
    def forgotten_prompt_keys(self) -> int:
        """How many remembered prompt keys were forgotten at `policy.sharing_max_keys`."""
        return 0 if self._sharing is None else self._sharing.forgotten

    def resolve_model(self, req: ClientRequest) -> ModelRoute:
        """The request's model; a missing model is fine when the fleet serves exactly one."""
        name = req.model
        if name is None:
            cards = self.registry.model_cards()
            if len(cards) != 1:
                raise RouterError(
                    UNKNOWN_MODEL, "'model' is required: the fleet serves several models"
                )
            name = str(cards[0]["id"])
        route = self.registry.route(name)
        if route is None and name in self._models:
            # a configured model nobody serves right now: the fleet is down, not the name wrong
            raise RouterError(
                NO_WORKER,
                f"no worker serves model `{name}` right now",
                retry_after=self._retry_after,
            )
        if route is None:
            raise RouterError(
                UNKNOWN_MODEL,
                f"The model `{name}` does not exist.",
                param="model",
                code="model_not_found",
            )
        return route

    def eligible(
        self, route: ModelRoute, exclude: Collection[str] = (), split: bool = True
    ) -> list[Worker]:
        """Workers that may run a request's prefill: mixed workers, and (for a request that
        can be `split`) prefill workers while a decode worker can take the rest; decode
        workers never start a request."""
        now = self._clock()
        ready = [w for w in self.registry.serving(route.name) if w.takes_requests(now)]
        has_decode = split and any(w.spec.role == DECODE for w in ready)
        return [
            w
            for w in ready
            if w.name not in exclude
            and (w.spec.role == BOTH or (w.spec.role == PREFILL and has_decode))
        ]

    def decode_pool(self, route: ModelRoute, exclude: Collection[str] = ()) -> list[Worker]:
        """The decode workers that may take a request's decode half now."""
        now = self._clock()
        return [
            w
            for w in self.registry.serving(route.name)
            if w.spec.role == DECODE and w.takes_requests(now) and w.name not in exclude
        ]

    def choose_decode(
        self,
        route: ModelRoute,
        prompt: Prompt,
        reuse: Mapping[str, int | None],
        exclude: Collection[str] = (),
        dry_run: bool = False,
    ) -> DecodeChoice:
        """The decode worker for a prompt whose prefill a prefill worker runs (chosen None
        when no decode worker can take it); see `kvroute.router.routing.decode_choice`.
        `dry_run`: only explain (equal workers' turn does not advance)."""
        pool = self.decode_pool(route, exclude)
        choice = choose_decode(
            pool, reuse, prompt.n_tokens, self.policy.load_model, self._pd, self._clock(),
            self.link_rate.bytes_per_s(), self._decode_turn, self.policy.decode_in_turn,
        )  # fmt: skip
        if choice.tied > 1 and not dry_run:
            self._decode_turn += 1
        return choice

    def decode_started(self, pulled_tokens: int, seconds: float) -> None:
        """A decode worker's first byte came `seconds` after dispatch, having pulled
        `pulled_tokens` prompt tokens (teaches `link_rate`)."""
        self.link_rate.observe(pulled_tokens, self._pd.kv_bytes_per_token, seconds)

    def sends_token_ids(self, route: ModelRoute) -> bool:
        """Whether the model's chat and completions requests go to the engine as completions of
        token ids."""
        spec = self._models.get(route.base)
        return spec is not None and spec.send_token_ids

    def any_eligible(self, route: ModelRoute) -> bool:
        return bool(self.eligible(route))

    async def prompt(self, req: ClientRequest, route: ModelRoute, partial: bool = False) -> Prompt:
        """Exact token ids when the model's tokenizer can give them; TokenizeError -> 400.

        `partial`: the caller will `complete` the prompt once the request is on its way, so
        a long new turn may be left unencoded (`Prompt.partial`) and the decision made on the
        conversation's cached start."""
        try:
            got = await self._tokenizers.token_ids(
                route.base,
                req.endpoint,
                req.body,
                lambda: self._render_worker(route),
                partial_min_chars=self._partial_min_chars if partial else 0,
                tenant=tenant_key(route.lora_name, req.cache_salt),
            )
        except ValueError as exc:  # kvroute.router.tokenize.TokenizeError subclasses ValueError
            raise RouterError(TOKENIZE, str(exc), param=getattr(exc, "param", None)) from None
        if got is None:
            self._metrics.child(self._metrics.token_source, "none").inc()
            estimate = max(1, len(req.raw) // BYTES_PER_TOKEN_ESTIMATE)
            return Prompt(None, "none", estimate, route.lora_name, req.cache_salt)
        self._metrics.child(self._metrics.token_source, got.source).inc()
        ids = got.token_ids
        spec = self._models.get(route.base)
        cacheable = not skips_prefix_cache(req, spec is not None and spec.embeddings_use_cache)
        pending = got.pending
        if pending is not None:
            n = pending.estimated_tokens
            return Prompt(
                ids, got.source, n, route.lora_name, req.cache_salt, cacheable, partial=got
            )
        return Prompt(ids, got.source, len(ids), route.lora_name, req.cache_salt, cacheable)

    async def complete(self, prompt: Prompt) -> bool:
        """Encode the rest of a partial prompt: True when its ids are now whole (the start's
        keys and coverage are dropped, so `reuse` scores the whole prompt). A rest that fails
        drops the ids altogether (the start alone would mislead an expectation) and returns
        False."""
        if prompt.partial is None:
            return True
        whole = await self._tokenizers.finish(prompt.partial)
        prompt.partial = prompt.keys = prompt.coverage = prompt.tiers = None
        if whole is None:
            prompt.token_ids = None
            return False
        prompt.token_ids = whole.token_ids
        prompt.n_tokens = len(whole.token_ids)
        return True

    def answer_target(
        self, req: ClientRequest, route: ModelRoute, prompt: Prompt
    ) -> AnswerTarget | None:
        """Where this request's answer can serve the conversation's next turn: chat prompts
        the router tokenized itself and vLLM caches, under the request's tenant."""
        if req.endpoint != CHAT or prompt.source != "local" or not prompt.cacheable:
            return None
        return AnswerTarget(route.base, tenant_key(route.lora_name, req.cache_salt))

    def remember_answer(
        self, target: AnswerTarget, body: Mapping[str, Any], answer_of: Callable[[], str | None]
    ) -> bool:
        """Have the target's tokenizer encode the conversation with its answer (`answer_of()`,
        read in the background) for the next turn; see `Tokenizers.remember_answer`."""
        return self._tokenizers.remember_answer(target.model, body, answer_of, tenant=target.tenant)

    def _render_worker(self, route: ModelRoute) -> str | None:
        workers = self.eligible(route)
        if not workers:
            return None
        return min(workers, key=lambda w: w.load.running).url

    def keys(self, prompt: Prompt) -> Sequence[int] | None:
        """The prompt's index keys, hashed on first use and kept on the prompt."""
        if prompt.keys is None and prompt.token_ids is not None:
            prompt.keys = self.index.prompt_keys(
                prompt.token_ids, prompt.lora_name, prompt.cache_salt
            )
        return prompt.keys

    def reuse(self, prompt: Prompt) -> Mapping[str, int | None]:
        """Predicted reuse per worker; streams that are down count as no evidence."""
        started = time.perf_counter()
        try:
            return self._reuse(prompt)
        finally:
            prompt.scoring_s = time.perf_counter() - started

    def _reuse(self, prompt: Prompt) -> Mapping[str, int | None]:
        if prompt.token_ids is None:
            return _EMPTY
        if not prompt.cacheable:
            return dict.fromkeys(self.registry.names(), 0)  # vLLM will reuse nothing
        try:
            scores = self._score(prompt, self.keys(prompt))
        except Exception as exc:  # an index bug must not fail requests: route without evidence
            self._ratelog.error("score", "index scoring failed, routing without it: %r", exc)
            self._metrics.child(self._metrics.errors, "index").inc()
            return _EMPTY
        down = self._unusable()
        if down:
            scores = {name: (None if name in down else v) for name, v in scores.items()}
            if prompt.coverage:
                prompt.coverage = {n: v for n, v in prompt.coverage.items() if n not in down}
        prompt.tiers = self._tiers(prompt, scores)
        return scores

    def _tiers(self, prompt: Prompt, scores: _Scores) -> Mapping[str, TierReuse] | None:
        """What the workers' lower tiers add beyond `scores` (None: nothing anywhere)."""
        assert prompt.token_ids is not None
        try:
            found = self.index.tiers(
                prompt.token_ids, scores, prompt.lora_name, prompt.cache_salt, self.keys(prompt)
            )
        except Exception as exc:  # an index bug must not fail requests: GPU reuse only
            self._ratelog.error("tiers", "lower-tier lookup failed, using GPU reuse only: %r", exc)
            self._metrics.child(self._metrics.errors, "index").inc()
            return None
        return found or None

    def _reach(self, prompt: Prompt, keys: Sequence[int] | None) -> _Scores:
        """Hybrid-correct reuse; the full-attention coverage goes on the prompt."""
        assert prompt.token_ids is not None
        scores, coverage = self.index.reach(
            prompt.token_ids, prompt.lora_name, prompt.cache_salt, keys
        )
        prompt.coverage = coverage
        return scores

    def _full_attention_only(self, prompt: Prompt, keys: Sequence[int] | None) -> _Scores:
        """Reuse as an index of full-attention groups only would predict it."""
        assert prompt.token_ids is not None
        explained = self.index.explain(prompt.token_ids, prompt.lora_name, prompt.cache_salt, keys)
        return {name: exp.full_attention_only() for name, exp in explained.items()}

    def decide(
        self,
        req: ClientRequest,
        route: ModelRoute,
        prompt: Prompt,
        reuse: Mapping[str, int | None],
        exclude: Collection[str] = (),
        split: bool = True,
    ) -> Decision:
        """Choose among eligible workers (prefill workers only for a request that can be
        `split`); raises 503 when there are none."""
        started = time.perf_counter()
        workers = self.eligible(route, exclude, split)
        decision = self.policy.decide(workers, self.route_input(req, prompt, reuse), self._clock())
        # scoring (`reuse`, called just before) is part of the decision's time
        self._decision_hist.observe(time.perf_counter() - started + prompt.scoring_s)
        prompt.scoring_s = 0.0
        self._metrics.child(self._decision_count, decision.policy, decision.reason).inc()
        if decision.chosen is None:
            raise RouterError(
                NO_WORKER,
                f"no healthy worker can serve model `{route.name}` right now",
                retry_after=self._retry_after,
            )
        self._note_conversation(decision, prompt)
        # Only prompts with hybrid coverage: a dense fleet (or the full-attention-only index)
        # never uses the answer, and a block nobody noted is credited anyway.
        if self._sharing is not None and prompt.coverage:
            keys = self.keys(prompt)
            if keys is not None:
                try:
                    self._sharing.note(keys, _owner(decision.session_key))
                except Exception as exc:  # a bookkeeping bug must not fail a routed request
                    self._sharing_failed(exc)
        return decision

    def route_input(
        self, req: ClientRequest, prompt: Prompt, reuse: Mapping[str, int | None]
    ) -> RouteInput:
        """What the policy sees of this request (the proxy and /admin/score alike)."""
        key = session_key(req.header_map, req.body, self.cfg)
        own_from = None
        if self._sharing is not None and prompt.coverage:
            keys = self.keys(prompt)
            if keys is not None:
                try:
                    own_from = self._sharing.own_from(keys, _owner(key))
                except Exception as exc:  # route as if the prompt were nobody's history
                    self._sharing_failed(exc)
        placement = self._placement(key, prompt) if self.cfg.placement_weight > 0 else None
        return RouteInput(
            prompt.n_tokens, reuse, key, prompt.coverage, own_from, prompt.tiers, placement
        )

    def _conversation_keys(self, prompt: Prompt) -> Sequence[int] | None:
        """The prompt's key chain when the policy reads reuse (hashed for it anyway)."""
        return self.keys(prompt) if self.policy.needs_reuse and prompt.cacheable else None

    def _placement(self, session: str | None, prompt: Prompt) -> PlacementInput:
        """The placement term's input: the working set, this request's conversation and the
        pools the engines report."""
        capacity: dict[str, int] = {}
        for w in self.registry:
            tokens = w.load.capacity.tokens()
            if tokens is not None:
                capacity[w.name] = tokens
        ws = self.working_set
        own = ws.find(session, self._conversation_keys(prompt))
        return PlacementInput(ws, own, capacity, self._clock())

    def _note_conversation(self, decision: Decision, prompt: Prompt) -> None:
        """Note the routed turn in the working set (a bookkeeping failure is logged, never
        raised: the request is routed)."""
        chosen = decision.chosen
        if chosen is None:
            return
        try:
            self.working_set.note(
                decision.session_key,
                self._conversation_keys(prompt),
                chosen.name,
                prompt.n_tokens,
                prompt.n_tokens - (chosen.reuse or 0),
                self._clock(),
            )
        except Exception as exc:
            self._ratelog.error("working_set", "working set bookkeeping failed: %r", exc)
            self._metrics.child(self._metrics.errors, "working_set").inc()

    def _sharing_failed(self, exc: Exception) -> None:
        self._ratelog.error("sharing", "prefix sharing bookkeeping failed: %r", exc)
        self._metrics.child(self._metrics.errors, "sharing").inc()

    def expect(self, worker: Worker, prompt: Prompt) -> None:
        """Credit the chosen worker with this prompt until its events arrive (or expiry).
        Not for a partial prompt: on hybrid workers an expectation credits state at the
        prompt's end, which the start's end is not."""
        if (
            prompt.token_ids is not None
            and prompt.partial is None
            and prompt.cacheable
            and self.cfg.expect_seconds > 0
        ):
            try:
                self.index.expect(
                    worker.name,
                    prompt.token_ids,
                    prompt.lora_name,
                    prompt.cache_salt,
                    self.cfg.expect_seconds,
                    self.keys(prompt),
                    # vLLM saves sparse state where full attention held the prompt (a junction)
                    (prompt.coverage or _EMPTY).get(worker.name) or 0,
                )
            except Exception as exc:
                self._ratelog.error("expect", "index expectation failed: %r", exc)
                self._metrics.child(self._metrics.errors, "index").inc()


def _owner(session: str | None) -> object:
    """Who asks for a prompt: its session, or (without a session key) the request alone."""
    return session if session is not None else object()
