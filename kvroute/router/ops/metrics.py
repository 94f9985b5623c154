"""The router's Prometheus metrics, on a registry owned by the app (no module globals).

Counters and histograms are updated where things happen (kvroute.router.ops.lite_metrics: plain
numbers
on cached label children, turned into Prometheus families at scrape time); per-worker state
(load, health, breaker, index statistics) is read at scrape time by `WorkerStateCollector`,
so the request path never touches those gauges.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvroute.router.fleet.breaker import STATE_CODES
from kvroute.router.ops.lite_metrics import CounterChild, HistogramChild, LiteFamily
from kvroute.router.ops.lite_metrics import LiteCounter as Counter
from kvroute.router.ops.lite_metrics import LiteHistogram as Histogram

if TYPE_CHECKING:
    from kvroute.router.fleet.event_subscriptions import EventFeed
    from kvroute.router.fleet.workers import WorkerRegistry
    from kvroute.router.routing.index_view import IndexView

_LATENCY = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_DECISION = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05)
_TOKENS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
_LAG = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
WORKER = "worker"  # the label naming a worker
EVENT_PREFIX = "kvroute_event_"  # the families of following event streams (index shards too)

# One series of a family: (family name, label values) -> its numbers: a counter's value, or a
# histogram's count per bucket (not cumulative, +Inf last) followed by its sum.
SeriesKey = tuple[str, tuple[str, ...]]


@runtime_checkable
class EventSeriesSource(Protocol):
    """An event feed that follows the streams elsewhere (index shards) and relays the
    `kvroute_event_*` series observed there."""

    def event_series(self) -> Mapping[SeriesKey, list[float]]: ...


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvroute_requests",
            "Requests answered, by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=r,
        )
        self.errors = Counter(
            "kvroute_errors", "Errors the router answered itself, by kind", ["kind"], registry=r
        )
        self.upstream = Counter(
            "kvroute_upstream_responses",
            "Upstream attempts by worker and outcome (2xx..5xx, connect, timeout)",
            ["worker", "outcome"],
            registry=r,
        )
        self.decisions = Counter(
            "kvroute_routing_decisions",
            "Routing decisions by policy and reason",
            ["policy", "reason"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "kvroute_routing_decision_seconds",
            "Time from token ids to chosen worker (index scoring + policy)",
            buckets=_DECISION,
            registry=r,
        )
        self.sent_as_ids = Counter(
            "kvroute_sent_as_token_ids",
            "Chat and completions requests for a model with send_token_ids, by endpoint and by "
            "whether they went to the engine as completions of token ids (yes) or as the client "
            "sent them (not_plain: fields only a chat or a text prompt has; no_exact_ids: no "
            "exact token ids; given_ids: the client sent ids)",
            ["endpoint", "result"],
            registry=r,
        )
        self.token_source = Counter(
            "kvroute_prompt_ids",
            "Requests by where their token ids came from (none = routed without ids)",
            ["source"],
            registry=r,
        )
        self.retries = Counter(
            "kvroute_retries", "Retries to another worker, by cause", ["cause"], registry=r
        )
        self.retry_budget_exhausted = Counter(
            "kvroute_retry_budget_exhausted", "Retries refused by the retry budget", registry=r
        )
        self.breaker_transitions = Counter(
            "kvroute_breaker_transitions",
            "Circuit breaker state changes",
            ["worker", "to"],
            registry=r,
        )
        self.health_checks = Counter(
            "kvroute_health_checks", "Active health checks", ["worker", "result"], registry=r
        )
        self.ttfb = Histogram(
            "kvroute_upstream_first_byte_seconds",
            "Time from dispatch to the first upstream body byte",
            ["worker"],
            buckets=_LATENCY,
            registry=r,
        )
        self.duration = Histogram(
            "kvroute_request_duration_seconds",
            "Whole request time in the router",
            ["endpoint"],
            buckets=_LATENCY,
            registry=r,
        )
        # prefill/decode disaggregation
        self.pd_phase_seconds = Histogram(
            "kvroute_pd_phase_seconds",
            "Disaggregated requests: prefill = the prefill worker's answer, decode_first_byte = "
            "from the decode dispatch (KV pull included) to its first byte",
            ["phase"],
            buckets=_LATENCY,
            registry=r,
        )
        self.pd_retries = Counter(
            "kvroute_pd_retries",
            "Disaggregated requests retried, by phase (prefill, decode) and cause",
            ["phase", "cause"],
            registry=r,
        )
        self.pd_pull_tokens = Counter(
            "kvroute_pd_pull_tokens",
            "Prompt tokens the chosen decode workers were predicted to pull from prefill",
            registry=r,
        )
        self.disconnects = Counter(
            "kvroute_client_disconnects", "Clients that went away mid-request", registry=r
        )
        self.usage_injected = Counter(
            "kvroute_stream_usage_requested",
            "Streams where the router asked for usage and hid it from the client",
            registry=r,
        )
        # verification
        self.predicted_tokens = Counter(
            "kvroute_predicted_cached_tokens",
            "Sum of predicted reusable tokens of verified responses",
            ["worker"],
            registry=r,
        )
        self.reported_tokens = Counter(
            "kvroute_reported_cached_tokens",
            "Sum of cached_tokens the engines reported",
            ["worker"],
            registry=r,
        )
        self.prediction_outcomes = Counter(
            "kvroute_prediction_outcomes",
            "Verified predictions: exact, over (predicted more), under, tokenizer_mismatch",
            ["worker", "outcome"],
            registry=r,
        )
        self.prediction_error = Histogram(
            "kvroute_prediction_error_tokens",
            "Absolute difference between predicted and reported cached tokens",
            ["worker"],
            buckets=_TOKENS,
            registry=r,
        )
        self.resyncs = Counter(
            "kvroute_index_resyncs",
            "Worker views discarded and resynchronised",
            ["worker", "cause"],
            registry=r,
        )
        # events
        self.event_batches = Counter(
            "kvroute_event_batches", "KV event batches applied", ["worker"], registry=r
        )
        self.event_snapshots = Counter(
            "kvroute_event_snapshots", "Snapshots applied", ["worker", "reason"], registry=r
        )
        self.event_stream_lost = Counter(
            "kvroute_event_stream_lost",
            "Event streams lost (view invalidated until back)",
            ["worker"],
            registry=r,
        )
        self.event_bad_messages = Counter(
            "kvroute_event_bad_messages",
            "Undecodable messages from a bridge (the stream is dropped and resubscribed)",
            ["worker"],
            registry=r,
        )
        self.event_queries_ahead = Counter(
            "kvroute_event_queries_ahead_of_batch",
            "Index queries an index shard answered ahead of a batch waiting to be applied "
            "(at most 16 per batch; 0 without index.processes)",
            registry=r,
        )
        self.event_apply_seconds = Histogram(
            "kvroute_event_apply_seconds",
            "Time to apply one batch or snapshot to the index (on the event loop)",
            buckets=_DECISION,
            registry=r,
        )
        self.event_lag_seconds = Histogram(
            "kvroute_event_lag_seconds",
            "From a batch's engine timestamp to its apply here (includes the apply delay and "
            "any clock offset between the engine's host and this one)",
            buckets=_LAG,
            registry=r,
        )
        self.bad_input_logged = Counter(
            "kvroute_log_suppressed", "Log lines suppressed by rate limiting", registry=r
        )
        # families labelled by worker: their series go when the worker does (pods renamed by
        # each rollout would otherwise pile up as dead series)
        self._per_worker: list[LiteFamily] = [
            m for m in vars(self).values() if isinstance(m, LiteFamily) and WORKER in m.labelnames
        ]

    def forget_worker(self, name: str) -> int:
        """Remove every series labelled `worker=name`; returns how many were removed."""
        return sum(f.remove_where(WORKER, lambda w: w != name) for f in self._per_worker)

    def keep_workers(self, names: Container[str]) -> int:
        """Remove the series of workers not in `names` (those counted after their removal,
        by a request or event still in flight then); returns how many were removed."""
        return sum(f.remove_where(WORKER, lambda w: w in names) for f in self._per_worker)

    @staticmethod
    def child(metric: Any, *values: str) -> Any:
        """`metric.labels(*values)` (children are cached by the metric itself)."""
        return metric.labels(*values)

    def attach_state(
        self,
        registry: WorkerRegistry,
        index: IndexView | None,
        events: EventFeed | None,
        clock: Callable[[], float] = time.monotonic,
        cpu_tier_tokens_per_s: float | None = None,
    ) -> None:
        """Export the per-worker gauges, read at scrape time. With `cpu_tier_tokens_per_s`
        (the configured rate, given when `policy.learn_cpu_tier_rate` learns each worker's),
        also the rate each worker's CPU-tier tokens are priced at and whether it is learned;
        without it those two gauges have no series."""
        self.registry.register(
            WorkerStateCollector(registry, index, events, clock, cpu_tier_tokens_per_s)
        )
        if isinstance(events, EventSeriesSource):
            # the streams are followed in other processes: export what they observed instead
            # of this process's (idle) event families, under the same names and buckets
            families = self.event_families()
            for f in families:
                self.registry.unregister(f)
            self.registry.register(RelayedFamilies(families, events.event_series))

    def event_families(self) -> list[LiteFamily]:
        """The families observed where event streams are followed (`kvroute_event_*`)."""
        return [
            m
            for m in vars(self).values()
            if isinstance(m, LiteFamily) and m.name.startswith(EVENT_PREFIX)
        ]


def family_series(families: Iterable[LiteFamily]) -> Iterator[tuple[SeriesKey, list[float]]]:
    """Every series of the families as (key, numbers), as `RelayedFamilies` takes them."""
    for f in families:
        for labels, child in list(f._children.items()):
            if isinstance(child, HistogramChild):
                yield (f.name, labels), [*map(float, child.counts), child.sum]
            elif isinstance(child, CounterChild):
                yield (f.name, labels), [child.value]


class RelayedFamilies(Collector):
    """Families whose series come from elsewhere at scrape time (`source`, keyed as
    `family_series` yields them), exported under the given families' names, labels and
    buckets. A series whose labels or bucket count do not fit its family is left out."""

    def __init__(
        self,
        families: list[LiteFamily],
        source: Callable[[], Mapping[SeriesKey, list[float]]],
    ) -> None:
        self._families = families
        self._source = source

    def collect(self) -> Iterator[Metric]:
        by_family: dict[str, list[tuple[tuple[str, ...], list[float]]]] = {}
        for (name, labels), values in self._source().items():
            by_family.setdefault(name, []).append((labels, values))
        for f in self._families:
            if isinstance(f, Histogram):
                hist = Histogram(f.name, f.doc, f.labelnames, buckets=f._bounds)
                for labels, values in by_family.get(f.name, ()):
                    if len(labels) == len(f.labelnames) and len(values) == len(f._bounds) + 2:
                        child = hist.labels(*labels)
                        child.counts = [int(v) for v in values[:-1]]
                        child.sum = values[-1]
                yield from hist.collect()
            else:
                counter = Counter(f.name, f.doc, f.labelnames)
                for labels, values in by_family.get(f.name, ()):
                    if len(labels) == len(f.labelnames) and len(values) == 1:
                        counter.labels(*labels).value = values[0]
                yield from counter.collect()


class ScalarGauge(Collector):
    """One unlabelled gauge (or, with `counter`, a counter) whose value is read at scrape time."""

    def __init__(
        self, name: str, doc: str, value: Callable[[], float], *, counter: bool = False
    ) -> None:
        self._name = name
        self._doc = doc
        self._value = value
        self._family = CounterMetricFamily if counter else GaugeMetricFamily

    def collect(self) -> Iterator[Metric]:
        yield self._family(self._name, self._doc, value=self._value())


class WorkerStateCollector(Collector):
    """Per-worker gauges computed at scrape time (a removed worker's series go with it)."""

    def __init__(
        self,
        workers: WorkerRegistry,
        index: IndexView | None,
        events: EventFeed | None,
        clock: Callable[[], float],
        cpu_tier_tokens_per_s: float | None = None,
    ) -> None:
        self._workers = workers
        self._index = index
        self._events = events
        self._clock = clock
        self._cpu_tier_configured = cpu_tier_tokens_per_s

    def collect(self) -> Iterator[Metric]:
        now = self._clock()

        def fam(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["worker"])

        running = fam("kvroute_worker_running", "Requests this process has in flight")
        queued = fam("kvroute_worker_queued_prefill_tokens", "Own prefill tokens not yet served")
        eng_running = fam("kvroute_worker_engine_running", "vllm:num_requests_running (scraped)")
        eng_waiting = fam("kvroute_worker_engine_waiting", "vllm:num_requests_waiting (scraped)")
        kv = fam("kvroute_worker_kv_usage", "vllm:kv_cache_usage_perc (scraped)")
        healthy = fam("kvroute_worker_healthy", "1 healthy, 0 unhealthy, -1 unknown")
        breaker = fam("kvroute_worker_breaker_state", "0 closed, 1 half-open, 2 open")
        draining = fam("kvroute_worker_draining", "1 when the worker is draining")
        valid = fam("kvroute_worker_index_valid", "1 when the worker's view is usable")
        entries = fam("kvroute_worker_index_entries", "Index entries held for the worker")
        live = fam("kvroute_worker_events_live", "1 when the event stream is live")
        lag = fam("kvroute_worker_events_age_seconds", "Seconds since the last event message")
        step = fam(
            "kvroute_worker_step_period_seconds",
            "Engine step period learned from relayed stream chunks (median of recent gaps)",
        )
        capacity = fam(
            "kvroute_worker_kv_capacity_tokens",
            "Tokens the worker's KV pool holds, from vllm:cache_config_info (scraped)",
        )
        cpu_rate = fam(
            "kvroute_worker_cpu_tier_tokens_per_second",
            "Rate the policy prices the worker's CPU-tier tokens at: learned from its engine's "
            "/metrics, bounded, or policy.cpu_tier_tokens_per_s until learned "
            "(with policy.learn_cpu_tier_rate)",
        )
        cpu_learned = fam(
            "kvroute_worker_cpu_tier_rate_learned",
            "1 when the worker's CPU-tier rate is learned, 0 while the configured one stands "
            "(with policy.learn_cpu_tier_rate)",
        )
        configured = self._cpu_tier_configured
        for w in self._workers:
            name = [w.name]
            running.add_metric(name, w.load.running)
            pool = w.load.capacity.tokens()
            if pool is not None:
                capacity.add_metric(name, pool)
            queued.add_metric(name, w.load.queued_prefill_tokens)
            m = w.load.engine
            if m is not None:
                eng_running.add_metric(name, m.running)
                eng_waiting.add_metric(name, m.waiting)
                if m.kv_usage is not None:
                    kv.add_metric(name, m.kv_usage)
            if w.load.steps.period is not None:
                step.add_metric(name, w.load.steps.period)
            if configured is not None:
                cpu_rate.add_metric(name, w.load.cpu_tier.tokens_per_s(configured))
                cpu_learned.add_metric(name, int(w.load.cpu_tier.learned is not None))
            healthy.add_metric(name, -1 if w.healthy is None else int(w.healthy))
            breaker.add_metric(name, STATE_CODES[w.breaker.state])
            draining.add_metric(name, int(w.state == "draining"))
            if self._index is not None:
                stats = self._index.stats(w.name)
                if stats is not None:
                    valid.add_metric(name, int(stats.valid))
                    entries.add_metric(name, stats.entries)
            if self._events is not None:
                status = self._events.status(w.name)
                if status is not None:
                    live.add_metric(name, int(status.state == "live"))
                    if status.last_message_at is not None:
                        lag.add_metric(name, max(0.0, now - status.last_message_at))
        yield from (running, queued, eng_running, eng_waiting, kv, healthy, breaker, draining)
        yield from (valid, entries, live, lag, step, capacity, cpu_rate, cpu_learned)
