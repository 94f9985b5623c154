"""The tokenizer's Prometheus series (`kvroute_tokenize_*`), on the registry it is given."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from kvroute.router.ops.lite_metrics import LiteCounter as Counter
from kvroute.router.ops.lite_metrics import LiteHistogram as Histogram
from kvroute.router.tokenize.prefix_cache import CacheStats


class TokenizeMetrics:
    """All series of one `Tokenizers`; `model` labels are configured names or "_default".

    Counters and histograms are kvroute.router.ops.lite_metrics' (no lock per update: they are
    updated
    once or twice per proxied request); the gauges are read at scrape time."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        # registry=None: the series exist but are registered nowhere (tests, benchmarks).
        self.results = Counter(
            "kvroute_tokenize_requests",
            "Requests by where their ids came from (local, render, request) or why not "
            "(unavailable, client_error)",
            ["model", "outcome"],
            registry=registry,
        )
        self.unavailable = Counter(
            "kvroute_tokenize_unavailable",
            "Requests routed without exact ids, by reason",
            ["model", "reason"],
            registry=registry,
        )
        self.seconds = Histogram(
            "kvroute_tokenize_seconds",
            "Time to get a request's ids, by mode",
            ["mode"],
            buckets=(0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0),
            registry=registry,
        )
        self.tokens = Counter(
            "kvroute_tokenize_prompt_tokens",
            "Prompt tokens produced locally: reused from the prefix cache, encoded now, or "
            "encoded ahead from an answer for the next turn (answer)",
            ["model", "kind"],
            registry=registry,
        )
        self.lookups = Counter(
            "kvroute_tokenize_prefix_cache_lookups",
            "Prefix cache lookups by result",
            ["result"],
            registry=registry,
        )
        self.mismatches = Counter(
            "kvroute_tokenize_prefix_cache_mismatches",
            "Cache hits whose ids differed from a from-scratch check (the cache is then off "
            "for that model)",
            ["model"],
            registry=registry,
        )
        self.answers = Counter(
            "kvroute_tokenize_answers",
            "Chat answers put into the prefix cache for the conversation's next turn, by "
            "result (remembered, nothing_new, busy: too many waiting, error)",
            ["model", "result"],
            registry=registry,
        )
        self.load_failures = Counter(
            "kvroute_tokenize_load_failures",
            "Local tokenizers that failed to load",
            ["model"],
            registry=registry,
        )
        self.cache_entries = Gauge(
            "kvroute_tokenize_prefix_cache_entries",
            "Entries in the prefix cache",
            registry=registry,
        )
        self.cache_bytes = Gauge(
            "kvroute_tokenize_prefix_cache_bytes",
            "Bytes held by the prefix cache",
            registry=registry,
        )
        self.cache_evictions = Gauge(
            "kvroute_tokenize_prefix_cache_evictions",
            "Entries evicted from the prefix cache since start",
            registry=registry,
        )

    def child(self, metric: Any, *values: str) -> Any:
        """`metric.labels(*values)`, cached."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def watch_cache(self, stats: Callable[[], CacheStats]) -> None:
        self.cache_entries.set_function(lambda: float(stats().entries))
        self.cache_bytes.set_function(lambda: float(stats().bytes))
        self.cache_evictions.set_function(lambda: float(stats().evictions))
