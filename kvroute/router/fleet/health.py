"""Active probes of every worker: /health (up or down), /v1/models (what it serves) and
/metrics (its load, see `kvroute.router.fleet.load`). Each probe runs periodically over all workers
at once;
a worker added at run time is probed immediately."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from kvroute.router.config import HealthConfig
from kvroute.router.edge.upstream import Upstream, UpstreamError
from kvroute.router.fleet.capacity import parse_cache_config
from kvroute.router.fleet.cpu_tier_rate import parse_cpu_tier_counters
from kvroute.router.fleet.load import EngineMetrics, parse_engine_metrics
from kvroute.router.fleet.workers import Worker, WorkerRegistry
from kvroute.router.ops.metrics import RouterMetrics

log = logging.getLogger("kvroute.router.health")

Probe = Callable[[Worker], Awaitable[None]]


# Workers probed together in one slice of a round: a round over thousands of workers is cut
# into slices spread evenly over its interval, so the loop never starts thousands of probes
# at once. A size chosen, not measured.
SLICE = 64


class Periodic:
    """Runs `probe` on every worker every `interval_s` seconds: each round's workers in slices
    of `SLICE`, their starts spread evenly over the interval, each slice's probes concurrent.
    With `due`, only the workers it accepts are probed (no task for the rest)."""

    def __init__(
        self,
        name: str,
        registry: WorkerRegistry,
        probe: Probe,
        interval_s: float,
        due: Callable[[Worker], bool] | None = None,
    ):
        self.name = name
        self._registry = registry
        self._probe = probe
        self._interval = interval_s
        self._due = due
        self._task: asyncio.Task[None] | None = None

    async def run_once(self, spread_s: float = 0.0) -> None:
        """One round over the workers registered now; with `spread_s`, the slices start
        `spread_s / slices` apart, the first after one such gap."""
        workers = list(self._registry)
        slices = [workers[i : i + SLICE] for i in range(0, len(workers), SLICE)]
        gap = spread_s / max(1, len(slices))
        if not slices and gap > 0:
            await asyncio.sleep(gap)
        for chunk in slices:
            if gap > 0:
                await asyncio.sleep(gap)
            due = self._due
            todo = [w for w in chunk if self._registry.get(w.name) is w and (due is None or due(w))]
            if todo:
                await asyncio.gather(*(self._safe(w) for w in todo))

    async def _safe(self, worker: Worker) -> None:
        try:
            await self._probe(worker)
        except Exception:  # a probe bug must not stop the loop
            log.exception("%s probe of %s failed", self.name, worker.name)

    def start(self) -> None:
        if self._task is None and self._interval > 0:
            self._task = asyncio.create_task(self._loop(), name=f"kvroute-{self.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _loop(self) -> None:
        while True:
            await self.run_once(spread_s=self._interval)


class HealthChecker:
    """GET /health: consecutive failures mark a worker unhealthy, successes healthy again."""

    def __init__(self, cfg: HealthConfig, upstream: Upstream, metrics: RouterMetrics) -> None:
        self._cfg = cfg
        self._upstream = upstream
        self._metrics = metrics

    async def __call__(self, worker: Worker) -> None:
        try:
            status, _ = await self._upstream.probe(worker.url + "/health")
            ok, error = status == 200, f"HTTP {status}"
        except UpstreamError as exc:
            ok, error = False, str(exc)
        self.record(worker, ok, error)

    def record(self, worker: Worker, ok: bool, error: str = "") -> None:
        self._metrics.health_checks.labels(worker.name, "ok" if ok else "fail").inc()
        if ok:
            worker.health_failures = 0
            worker.health_successes += 1
            worker.health_error = ""
            if worker.healthy is not True and (
                worker.healthy is None or worker.health_successes >= self._cfg.healthy_after
            ):
                if worker.healthy is False:
                    log.info("worker %s healthy again", worker.name)
                worker.healthy = True
        else:
            worker.health_successes = 0
            worker.health_failures += 1
            worker.health_error = error
            if worker.healthy is not False and (
                worker.healthy is None or worker.health_failures >= self._cfg.unhealthy_after
            ):
                log.warning("worker %s unhealthy: %s", worker.name, error)
                worker.healthy = False


class _ModelList(msgspec.Struct):
    data: list[dict[str, Any]]


_models_decoder = msgspec.json.Decoder(_ModelList)


class ModelsProbe:
    """GET /v1/models: the ids a worker serves (base models and LoRA adapters)."""

    def __init__(
        self,
        registry: WorkerRegistry,
        upstream: Upstream,
        on_models: Callable[[Worker], None] | None = None,
    ) -> None:
        self._registry = registry
        self._upstream = upstream
        self._on_models = on_models

    async def __call__(self, worker: Worker) -> None:
        try:
            status, body = await self._upstream.probe(worker.url + "/v1/models")
        except UpstreamError:
            return  # health reports reachability; keep the last known list
        if status != 200:
            return
        try:
            listing = _models_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
            log.warning("worker %s: /v1/models is not a model list", worker.name)
            return
        cards = {str(card["id"]): card for card in listing.data if isinstance(card.get("id"), str)}
        self._registry.set_models(worker, cards)
        if self._on_models is not None:
            self._on_models(worker)


# A page showing KV usage below this fraction of policy.kv_usage_saturation may be read less
# often; above it, every metrics_interval_s. A margin chosen, not measured.
KV_QUIET_FRACTION = 0.9


class MetricsProbe:
    """GET /metrics: the engine's running / waiting requests and KV usage for this DP rank, and
    with `cpu_tier_rate` the counters its CPU-tier load rate is learned from
    (`kvroute.router.fleet.cpu_tier_rate`).

    Each worker is read every `base_s` while its pages show something this process does not
    know (another router's requests, KV usage at `kv_quiet_below` or more), otherwise less
    and less often, down to every `max_s` (`ScrapeBackoff`)."""

    def __init__(
        self,
        upstream: Upstream,
        clock: Callable[[], float] = time.monotonic,
        *,
        base_s: float = 1.0,
        max_s: float = 1.0,
        kv_quiet_below: float = 1.0,
        cpu_tier_rate: bool = False,
    ) -> None:
        self._upstream = upstream
        self._cpu_tier_rate = cpu_tier_rate
        self._clock = clock
        self._base = base_s
        self._max = max_s
        self._kv_quiet_below = kv_quiet_below

    def due(self, worker: Worker) -> bool:
        """Whether the worker's next read is due (`ScrapeBackoff`)."""
        return worker.load.scrape.due(self._clock())

    async def __call__(self, worker: Worker) -> None:
        load = worker.load
        if not self.due(worker):
            return
        running_before, prefilling_before = load.running, load.prefilling
        try:
            status, body = await self._upstream.probe(worker.url + "/metrics")
        except UpstreamError:
            return
        if status != 200:
            return
        text = body.decode("utf-8", "replace")
        parsed = parse_engine_metrics(text, worker.spec.dp_rank)
        if parsed is None:
            return
        cache = parse_cache_config(text, worker.spec.dp_rank)
        if cache is not None:
            load.capacity.engine = cache
        if self._cpu_tier_rate:
            counters = parse_cpu_tier_counters(text, worker.spec.dp_rank)
            if counters is not None:
                load.cpu_tier.observe(*counters)
        running, waiting, usage = parsed
        now = self._clock()
        # A request sent while the scrape was on its way may already be in the engine's
        # count; taking the larger own count (before or after) keeps it from being read as
        # another router's load. Erring this way only under-counts for one scrape period.
        load.engine = EngineMetrics(
            running,
            waiting,
            usage,
            now,
            max(running_before, load.running),
            max(prefilling_before, load.prefilling),
        )
        quiet = load.others(now, float("inf")) == (0, 0) and (
            usage is None or usage < self._kv_quiet_below
        )
        load.scrape.scraped(now, quiet, self._base, self._max)
