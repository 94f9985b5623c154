"""The app factory: builds every component from the config and wires them explicitly.

Nothing is global; everything a request needs hangs off the objects created here. Tests and
benchmarks call `create_app(config, ...)` with their own index, tokenizer or event transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvroute.router.config import RouterConfig, TokenizerConfig
from kvroute.router.edge.openai_request import GENERATION_ENDPOINTS
from kvroute.router.edge.passthrough import Passthrough
from kvroute.router.edge.proxy import Proxy, ProxyEndpoint
from kvroute.router.edge.refusals import counting_refusals
from kvroute.router.edge.trust import TrustedPeers
from kvroute.router.edge.upstream import Upstream
from kvroute.router.fleet.discovery import parse_discovery_config, start_discovery
from kvroute.router.fleet.event_subscriptions import (
    EventFeed,
    EventSubscriptions,
    TransportFactory,
    default_transport,
)
from kvroute.router.fleet.health import (
    KV_QUIET_FRACTION,
    HealthChecker,
    MetricsProbe,
    ModelsProbe,
    Periodic,
)
from kvroute.router.fleet.load import PrefillRateEstimate, PromptSizeEstimate
from kvroute.router.fleet.verify import Verifier
from kvroute.router.fleet.workers import StaticDiscovery, Worker, WorkerRegistry
from kvroute.router.ops import dashboard
from kvroute.router.ops.admin import Admin
from kvroute.router.ops.admin_auth import AdminTokens
from kvroute.router.ops.decisions import DecisionLog
from kvroute.router.ops.metrics import RouterMetrics, ScalarGauge
from kvroute.router.ops.probes import Probes
from kvroute.router.routing.index_view import IndexView
from kvroute.router.routing.pipeline import Routing, TokenizerLike
from kvroute.router.routing.policy import LoadModel, Policy, make_policy
from kvroute.router.tokenize import Tokenizers, TokenizerSpec

if TYPE_CHECKING:
    from kvroute.router.index_shards.setup import ShardedIndex

log = logging.getLogger("kvroute.router")


@dataclass(slots=True)
class Components:
    """Everything the app is made of (for tests, benchmarks and the CLI)."""

    config: RouterConfig
    metrics: RouterMetrics
    registry: WorkerRegistry
    index: IndexView
    events: EventFeed
    routing: Routing
    proxy: Proxy
    verifier: Verifier
    decisions: DecisionLog
    upstream: Upstream
    policy: Policy
    prefill_rate: PrefillRateEstimate
    shards: ShardedIndex | None = None  # with index.processes > 0


def tokenizer_specs(cfg: RouterConfig) -> tuple[dict[str, TokenizerSpec], TokenizerSpec | None]:
    def spec(value: str | None, template: str | None) -> TokenizerSpec | None:
        if value is None:
            return None
        if value in ("render", "request"):
            return TokenizerSpec(value, chat_template=template)  # type: ignore[arg-type]
        return TokenizerSpec("local", path=value, chat_template=template)

    specs = {}
    for name, model in cfg.models.items():
        s = spec(model.tokenizer, model.chat_template)
        if s is not None:
            specs[name] = s
    return specs, spec(cfg.tokenizer.default, None)


def build_tokenizers(cfg: RouterConfig, upstream: Upstream, metrics: RouterMetrics) -> Tokenizers:
    specs, default = tokenizer_specs(cfg)
    t: TokenizerConfig = cfg.tokenizer
    return Tokenizers(
        specs,
        default=default,
        threads=t.threads,
        cache_entries=t.cache_entries,
        render_timeout_s=t.render_timeout_s,
        inline_chars=t.inline_chars,
        registry=metrics.registry,
        http=upstream,
    )


def build_index(cfg: RouterConfig) -> IndexView:
    module = importlib.import_module(
        "kvroute.router.routing.fleet_index_view"
    )  # needs the indexer package
    view: IndexView = module.FleetIndexView(
        hash_unit=cfg.policy.hash_unit,
        max_entries_per_worker=cfg.events.max_entries_per_worker,
        max_pending_per_worker=cfg.events.max_pending_per_worker,
    )
    return view


async def _await_shards(ready: Callable[[], bool], timeout_s: float = 15.0) -> None:
    """Wait (bounded) for the index shards to answer before serving; /readyz says so."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            log.warning("index shards not answering after %.0f s; serving without them", timeout_s)
            return
        await asyncio.sleep(0.02)


class _Housekeeping:
    """Registry listener: probe new workers at once, forget removed ones everywhere."""

    def __init__(
        self,
        probes: list[Callable[[Worker], Any]],
        verifier: Verifier,
        policy: Policy,
        metrics: RouterMetrics,
        routing: Routing,
    ) -> None:
        self._probes = probes
        self._verifier = verifier
        self._policy = policy
        self._metrics = metrics
        self._routing = routing
        self.started = False
        self._tasks: set[asyncio.Task[None]] = set()

    def worker_added(self, worker: Worker) -> None:
        if not self.started:
            return

        async def probe() -> None:
            for p in self._probes:
                await p(worker)

        task = asyncio.create_task(probe())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def worker_removed(self, worker: Worker) -> None:
        self._verifier.forget(worker.name)
        self._policy.forget_worker(worker.name)
        self._routing.working_set.forget_worker(worker.name)
        self._metrics.forget_worker(worker.name)


class RouterApp(Starlette):
    """Starlette with the proxy routes dispatched first, straight to their ASGI endpoints.

    The proxy endpoints are plain ASGI apps that answer every error themselves, so
    Starlette's routing table and exception middleware only cost time on the hot path
    (about a tenth of the router's CPU per request); every other route goes through
    Starlette as usual (a GET on a proxy path still gets Starlette's 405).
    """

    def __init__(self, fast_post: dict[str, ProxyEndpoint], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._fast_post = fast_post

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self._fast_post.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self
                await endpoint(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(
    cfg: RouterConfig,
    *,
    index: IndexView | None = None,
    tokenizers: TokenizerLike | None = None,
    transport_factory: TransportFactory | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Starlette:
    """Build the router app. The returned app's `state.kvroute` holds its `Components`."""
    metrics = RouterMetrics()
    upstream = Upstream(
        cfg.timeouts, cfg.limits, pool_wait_s=cfg.edge.pool_wait_s, tls=cfg.upstream_tls
    )
    registry = WorkerRegistry(
        cfg.breaker,
        max_workers=cfg.limits.max_workers,
        on_breaker_change=lambda w, old, new: metrics.breaker_transitions.labels(w.name, new).inc(),
    )
    events: EventFeed
    sharded = None
    if index is None and cfg.index.processes > 0:
        # the index in shard processes, which follow the events themselves
        from kvroute.router.index_shards.setup import build_sharded

        sharded = build_sharded(cfg, metrics.registry, clock)
        index, events = sharded.view, sharded.events
    else:
        index = index if index is not None else build_index(cfg)
        if transport_factory is None:
            transport_factory = functools.partial(default_transport, cfg=cfg.events)
        events = EventSubscriptions(index, cfg.events, metrics, transport_factory, clock)
    registry.listen(events)
    verifier = Verifier(cfg.verify, metrics, events.resync, clock)
    prompt_size = PromptSizeEstimate(cfg.policy.avg_prompt_tokens)
    prefill_rate = PrefillRateEstimate(cfg.policy.prefill_tokens_per_s)
    stale_after = max(5.0, 3 * cfg.load.metrics_interval_s)
    load_model = LoadModel(
        cfg.policy,
        lambda: prompt_size.value,
        stale_after,
        (lambda: prefill_rate.value) if cfg.policy.learn_prefill_rate else None,
    )
    policy = make_policy(cfg.policy, load_model)
    own_tokenizers = tokenizers is None
    tok: Any = tokenizers if tokenizers is not None else build_tokenizers(cfg, upstream, metrics)
    routing = Routing(
        registry,
        index,
        policy,
        cfg.policy,
        cfg.models,
        tok,
        metrics,
        unusable=events.unusable,
        clock=clock,
        retry_after_s=cfg.timeouts.retry_after_s,
        partial_min_chars=cfg.tokenizer.partial_min_chars,
        pd=cfg.pd,
    )
    decisions = DecisionLog(cfg.limits.decisions_buffer)
    proxy = Proxy(
        cfg,
        routing,
        upstream,
        registry,
        verifier,
        decisions,
        metrics,
        prompt_size,
        clock,
        prefill_rate=prefill_rate,
    )
    metrics.attach_state(
        registry,
        index,
        events,
        clock,
        cpu_tier_tokens_per_s=(
            cfg.policy.cpu_tier_tokens_per_s if cfg.policy.learn_cpu_tier_rate else None
        ),
    )
    metrics.registry.register(
        ScalarGauge(
            "kvroute_prefill_tokens_per_second",
            "Prefill rate the policy converts tokens to seconds with (configured or learned)",
            lambda: 1.0 / load_model.seconds_per_token(),
        )
    )
    metrics.registry.register(
        ScalarGauge(
            "kvroute_prefill_tokens_per_second_measured",
            "Prefill rate measured from streamed first bytes (policy.prefill_tokens_per_s "
            "until enough streams were seen)",
            lambda: prefill_rate.value,
        )
    )
    metrics.registry.register(
        ScalarGauge(
            "kvroute_prefix_sharing_keys",
            "Prompt index keys remembered with the session that asked for them (junction "
            "credit; bounded by policy.sharing_max_keys)",
            lambda: routing.remembered_prompt_keys,
        )
    )
    metrics.registry.register(
        ScalarGauge(
            "kvroute_prefix_sharing_forgotten",
            "Remembered prompt keys forgotten at policy.sharing_max_keys (oldest first); "
            "a fast rise means the bound is too small for the traffic",
            lambda: routing.forgotten_prompt_keys,
            counter=True,
        )
    )
    metrics.registry.register(
        ScalarGauge(
            "kvroute_working_set_conversations",
            "Conversations this router expects back on its workers (bounded by "
            "policy.working_set_max_conversations)",
            lambda: len(routing.working_set),
        )
    )
    metrics.registry.register(
        ScalarGauge(
            "kvroute_working_set_forgotten",
            "Conversations forgotten at policy.working_set_max_conversations (least recently "
            "routed first); a fast rise means the bound is too small for the traffic",
            lambda: routing.working_set.forgotten,
            counter=True,
        )
    )
    metrics.registry.register(
        ScalarGauge(
            "kvroute_event_loop_stalled_seconds",
            "Time this process's event loop could not run (late by 5 ms or more) while an "
            "upstream connect or probe was pending; their timeouts do not count it",
            lambda: upstream.stalls.total_s,
            counter=True,
        )
    )

    def apply_alignment(worker: Worker) -> None:
        for name in worker.serves():
            route = registry.route(name)
            spec = cfg.models.get(route.base if route else name)
            if spec is not None and spec.alignment is not None:
                index.set_alignment(worker.name, spec.alignment)

    health = HealthChecker(cfg.health, upstream, metrics)
    models_probe = ModelsProbe(registry, upstream, on_models=apply_alignment)
    metrics_probe = MetricsProbe(
        upstream,
        clock,
        base_s=cfg.load.metrics_interval_s,
        max_s=cfg.load.metrics_max_interval_s,
        kv_quiet_below=KV_QUIET_FRACTION * cfg.policy.kv_usage_saturation,
        cpu_tier_rate=cfg.policy.learn_cpu_tier_rate,
    )

    async def peak_blocks(worker: Worker) -> None:
        # the most blocks the index has seen each KV group of the worker hold
        stats = index.stats(worker.name)
        if stats is not None:
            worker.load.capacity.observe_blocks(stats.blocks_per_group)

    housekeeping = _Housekeeping(
        [health, models_probe, metrics_probe], verifier, policy, metrics, routing
    )
    registry.listen(housekeeping)
    jobs = [
        Periodic("health", registry, health, cfg.health.interval_s),
        Periodic("models", registry, models_probe, cfg.health.models_interval_s),
        Periodic(
            "metrics", registry, metrics_probe, cfg.load.metrics_interval_s, metrics_probe.due
        ),
        Periodic("peak_blocks", registry, peak_blocks, cfg.load.metrics_interval_s),
    ]
    admin = Admin(
        AdminTokens.from_config(cfg.admin),
        registry,
        routing,
        index,
        events,
        verifier,
        decisions,
        metrics,
        clock,
    )
    passthrough = Passthrough(
        registry,
        upstream,
        metrics,
        proxy.bodies,
        cfg.timeouts.retry_after_s,
        clock,
        TrustedPeers(cfg.edge.trusted_proxies),
    )

    probes = Probes(
        registry,
        [*cfg.models, *(w.model for w in cfg.workers if w.model)],
        clock,
        index_ready=sharded.events.ready if sharded is not None else None,
    )

    async def metrics_endpoint(request: Request) -> Response:
        # series counted for a worker after it was removed (a request still in flight then)
        metrics.keep_workers(set(registry.names()))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    endpoints = {path: proxy.endpoint(path) for path in GENERATION_ENDPOINTS}
    routes: list[Route] = [
        Route(path, endpoint, methods=["POST"]) for path, endpoint in endpoints.items()
    ]
    routes += [
        Route("/v1/models", passthrough.models, methods=["GET"]),
        Route("/tokenize", passthrough.forward, methods=["POST"]),
        Route("/detokenize", passthrough.forward, methods=["POST"]),
        Route("/health", passthrough.health, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        *probes.routes(),
        *admin.routes(),
        *dashboard.routes(),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if sharded is not None and sharded.supervisor is not None:
            sharded.supervisor.start()
        await upstream.start()
        start = getattr(tok, "start", None)
        if own_tokenizers and start is not None:
            await start()
        await StaticDiscovery(cfg.workers).run(registry)
        discovery = (
            await start_discovery(parse_discovery_config(cfg.discovery), registry)
            if cfg.discovery
            else None
        )
        # First probes before serving, so the first request sees health and models.
        for job in jobs:
            await job.run_once()
        housekeeping.started = True
        await events.start()
        if sharded is not None:
            await _await_shards(sharded.events.ready)
        for job in jobs:
            job.start()
        log.info(
            "router ready: %d workers, policy %s, %d models",
            len(registry),
            policy.name,
            len(registry.model_cards()),
        )
        refused = metrics.child(metrics.errors, "concurrency_limit")
        try:
            with counting_refusals(refused.inc):
                yield
        finally:
            if discovery is not None:
                await discovery.stop()
            for job in jobs:
                await job.stop()
            await events.stop()
            aclose = getattr(tok, "aclose", None)
            if own_tokenizers and aclose is not None:
                await aclose()
            await upstream.close()
            if sharded is not None and sharded.supervisor is not None:
                await asyncio.to_thread(sharded.supervisor.stop)

    app = RouterApp(dict(endpoints), routes=routes, lifespan=lifespan)
    app.state.kvroute = Components(
        cfg,
        metrics,
        registry,
        index,
        events,
        routing,
        proxy,
        verifier,
        decisions,
        upstream,
        policy,
        prefill_rate,
        sharded,
    )
    return app
