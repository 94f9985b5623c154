"""The engine's Prometheus metrics, with vLLM's names, labels and buckets (one registry each)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvroute.sim.cache_api import CacheSpec

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
LABELS = ("model_name", "engine")
# vLLM's CacheHitSource values (vllm/v1/metrics/cache_hit_source.py), every one exported at 0
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
# vLLM's TRANSFER_SIZE_BUCKETS (distributed/kv_transfer/kv_connector/v1/offloading/metrics.py)
TRANSFER_SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)


class EngineMetrics:
    """vLLM-named series: vllm:num_requests_running, vllm:kv_cache_usage_perc, ...

    Counters are exposed with prometheus_client's `_total` suffix, as vLLM's are.
    """

    def __init__(self, model_name: str, engine: str = "0") -> None:
        self.registry = CollectorRegistry()
        r, lv = self.registry, (model_name, engine)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=r).labels(*lv)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=r).labels(*lv)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*lv)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens",
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens"
        )
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed"
        )
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests",
            [*LABELS, "finished_reason"],
            registry=r,
        )
        self._labels = lv
        self._by_source = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), "
            "host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
            "external_unspecified. Counted at admission.",
            [*LABELS, "source"],
            registry=r,
        )
        for source in CACHE_HIT_SOURCES:
            self._by_source.labels(*lv, source)
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token in seconds", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency in seconds", ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "E2E request latency in seconds", LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Time spent in WAITING phase for request",
            LATENCY_BUCKETS,
        )

    def cache_config(self, spec: CacheSpec) -> None:
        """Export `vllm:cache_config_info` as vLLM does: an info gauge (value 1) whose labels
        are cache settings, here the ones a router reads (`num_gpu_blocks`, `block_size`, the
        group-aware `kv_cache_size_tokens`) plus `engine`."""
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ("block_size", "enable_prefix_caching", "num_gpu_blocks", "kv_cache_size_tokens",
             "engine"),
            registry=self.registry,
        )  # fmt: skip
        info.labels(
            str(spec.scheduler_block_size),
            str(spec.enable_caching),
            str(spec.num_blocks),
            str(kv_cache_size_tokens(spec)),
            self._labels[1],
        ).set(1)

    def offloading(self) -> None:
        """Declare the CPU tier's load series as vLLM's offloading connector does
        (`get_connector_metric_definitions` in its offloading/metrics.py): an engine without
        a CPU tier has none, and each series appears at its first load."""
        r = self.registry
        self._load_bytes = Counter(
            "vllm:kv_offload_load_bytes",
            "Total bytes loaded from offload storage to GPU.",
            LABELS,
            registry=r,
        )
        self._load_time = Counter(
            "vllm:kv_offload_load_time",
            "Total load time from offload storage to GPU, in seconds.",
            LABELS,
            registry=r,
        )
        self._load_size = Histogram(
            "vllm:kv_offload_load_size",
            "Histogram of KV offload load operation size, in bytes.",
            LABELS,
            buckets=TRANSFER_SIZE_BUCKETS,
            registry=r,
        )

    def offload_loaded(self, num_bytes: float, seconds: float) -> None:
        """One finished load from the CPU tier: its bytes and the time the copy took."""
        self._load_bytes.labels(*self._labels).inc(num_bytes)
        self._load_time.labels(*self._labels).inc(seconds)
        self._load_size.labels(*self._labels).observe(num_bytes)

    def cached_by_source(self, source: str, tokens: int) -> None:
        """Count prompt tokens a request found cached in `source` (one of CACHE_HIT_SOURCES)."""
        if tokens:
            self._by_source.labels(*self._labels, source).inc(tokens)

    def finished(self, reason: str) -> None:
        """Count a request that finished for `reason` (stop, length)."""
        self._success.labels(*self._labels, reason).inc()


def kv_cache_size_tokens(spec: CacheSpec) -> int:
    """vLLM's group-aware capacity: how many max_model_len requests the pool admits (each takes
    its admission blocks from every group, all from one pool) times max_model_len."""
    length = spec.max_model_len
    in_flight = spec.max_in_flight_tokens or length
    per_request = 0
    for g in spec.groups:
        if g.kind == "sliding_window":
            window = min((g.sliding_window or 0) - 1 + in_flight, length)
            per_request += -(-window // g.block_size) + 1  # a window may straddle a block
        elif g.kind == "mamba":
            per_request += 2  # the state and one prefix-caching checkpoint
        else:
            per_request += -(-length // g.block_size)
    return int(spec.num_blocks / per_request * length)
