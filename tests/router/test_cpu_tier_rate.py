"""`kvroute.router.fleet.cpu_tier_rate`: a worker's CPU-tier load rate from its engine's
counters (host tokens, load seconds), against no data, skew, resets and absurd values; and
the rate each worker is priced at as the router's metrics export it."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry

from kvroute.router.config import BreakerConfig, WorkerSpec
from kvroute.router.fleet.cpu_tier_rate import (
    BOUND,
    MIN_LOADS,
    MIN_TOKENS,
    CpuTierRate,
    parse_cpu_tier_counters,
)
from kvroute.router.fleet.workers import WorkerRegistry
from kvroute.router.ops.metrics import RouterMetrics

CONFIGURED = 200_000.0


class Counters:
    """An engine's two counters, advanced load by load."""

    def __init__(self, rate: CpuTierRate) -> None:
        self.rate = rate
        self.tokens = 0.0
        self.seconds = 0.0

    def load(self, tokens: float, tokens_per_s: float) -> None:
        self.tokens += tokens
        self.seconds += tokens / tokens_per_s

    def scrape(self) -> None:
        self.rate.observe(self.tokens, self.seconds)


def warmed(tokens_per_s: float, loads: int) -> tuple[CpuTierRate, Counters]:
    """A rate that saw ``loads`` loads of 1,000 tokens at ``tokens_per_s``, and its engine."""
    rate = CpuTierRate()
    engine = Counters(rate)
    engine.scrape()
    for _ in range(loads):
        engine.load(1000.0, tokens_per_s)
        engine.scrape()
    return rate, engine


def test_no_data_prices_at_the_configured_rate() -> None:
    rate = CpuTierRate()
    assert rate.learned is None and rate.tokens_per_s(CONFIGURED) == CONFIGURED
    rate.observe(5000.0, 0.1)  # one scrape is only a baseline
    rate.observe(5000.0, 0.1)  # and an idle one teaches nothing
    assert rate.learned is None and rate.joins == 0


def test_the_rate_is_learned_after_enough_loads() -> None:
    rate = CpuTierRate()
    engine = Counters(rate)
    engine.scrape()
    per_load = MIN_TOKENS / (MIN_LOADS - 1)
    for i in range(MIN_LOADS):
        assert rate.learned is None and rate.tokens_per_s(CONFIGURED) == CONFIGURED
        engine.load(per_load if i < MIN_LOADS - 1 else 1.0, 50_000.0)
        engine.scrape()
    assert rate.learned == pytest.approx(50_000.0)
    assert rate.tokens_per_s(CONFIGURED) == pytest.approx(50_000.0)


def test_tokens_and_time_seen_in_different_scrapes_are_joined() -> None:
    rate = CpuTierRate()
    engine = Counters(rate)
    engine.scrape()
    for _ in range(6):
        engine.tokens += 1000.0  # admitted: host tokens counted before the copy is done
        engine.scrape()
        engine.seconds += 1000.0 / 40_000.0  # the copy's time
        engine.scrape()
    assert rate.joins == 6 and rate.learned == pytest.approx(40_000.0)


def test_the_rate_follows_a_change_smoothly() -> None:
    rate, engine = warmed(50_000.0, 10)
    seen = []
    for _ in range(15):
        engine.load(1000.0, 100_000.0)
        engine.scrape()
        learned = rate.learned
        assert learned is not None
        seen.append(learned)
    assert seen == sorted(seen) and 50_000.0 < seen[0] < 75_000.0  # one load moves it some
    assert 95_000.0 < seen[-1] < 100_000.0  # the old rate fades (KEEP per load)


def test_a_counter_reset_starts_a_new_baseline_and_keeps_what_was_learned() -> None:
    rate, engine = warmed(50_000.0, 5)
    joins = rate.joins
    engine.tokens, engine.seconds = 300.0, 0.001  # the engine restarted (and loaded since)
    engine.scrape()
    assert rate.joins == joins and rate.learned == pytest.approx(50_000.0)
    engine.load(1000.0, 50_000.0)
    engine.scrape()
    assert rate.joins == joins + 1 and rate.learned == pytest.approx(50_000.0)
    # one counter reset alone (tokens down, time up) is a reset too
    engine.tokens = 0.0
    engine.seconds += 1.0
    engine.scrape()
    assert rate.joins == joins + 1 and rate.learned == pytest.approx(50_000.0)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0])
def test_values_that_are_no_counter_are_ignored(bad: float) -> None:
    rate, engine = warmed(50_000.0, 5)
    joins = rate.joins
    rate.observe(bad, engine.seconds)
    rate.observe(engine.tokens, bad)
    assert rate.joins == joins and rate.learned == pytest.approx(50_000.0)
    engine.load(1000.0, 50_000.0)
    engine.scrape()  # the baseline was dropped: this scrape is a new one
    assert rate.joins == joins
    engine.load(1000.0, 50_000.0)
    engine.scrape()
    assert rate.joins == joins + 1


def test_an_absurd_rate_is_bounded_and_untimed_loads_teach_nothing() -> None:
    for tokens_per_s, priced in ((1e12, CONFIGURED * BOUND), (1.0, CONFIGURED / BOUND)):
        rate, _ = warmed(tokens_per_s, 5)
        assert rate.learned == pytest.approx(tokens_per_s)
        assert rate.tokens_per_s(CONFIGURED) == pytest.approx(priced)
    # a connector that does not time its loads: tokens only, the configured rate stays
    rate = CpuTierRate()
    for tokens in range(0, 100_000, 1000):
        rate.observe(float(tokens), 0.0)
    assert rate.learned is None and rate.tokens_per_s(CONFIGURED) == CONFIGURED


PAGE = """\
# HELP vllm:prompt_tokens_cached_by_source_total Prefix-cache hit tokens by the cache tier
# TYPE vllm:prompt_tokens_cached_by_source_total counter
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="device"} 9000.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="host"} 1200.0
vllm:prompt_tokens_cached_by_source_total{engine="1",model_name="m",source="host"} 800.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="disk"} 64.0
# HELP vllm:kv_offload_load_time_total Total load time from offload storage to GPU, in seconds.
# TYPE vllm:kv_offload_load_time_total counter
vllm:kv_offload_load_time_total{engine="0",model_name="m"} 0.012
vllm:kv_offload_load_time_total{engine="1",model_name="m"} 0.5
vllm:kv_offload_load_time_created{engine="0",model_name="m"} 1.7e9
"""


def test_the_counters_are_read_per_dp_rank_from_vllms_page() -> None:
    assert parse_cpu_tier_counters(PAGE, 0) == (1200.0, 0.012)
    assert parse_cpu_tier_counters(PAGE, 1) == (800.0, 0.5)
    # before the first load vLLM has no load-time series yet: 0
    no_load = "\n".join(line for line in PAGE.splitlines() if "load_time" not in line)
    assert parse_cpu_tier_counters(no_load, 0) == (1200.0, 0.0)
    # no host series: no CPU tier (or a vLLM before it), nothing to learn
    assert parse_cpu_tier_counters(PAGE.replace('source="host"', 'source="p2p"'), 0) is None
    assert parse_cpu_tier_counters("", 0) is None


RATE = "kvroute_worker_cpu_tier_tokens_per_second"
LEARNED = "kvroute_worker_cpu_tier_rate_learned"


def fleet(configured: float | None) -> tuple[WorkerRegistry, CollectorRegistry]:
    """Workers w0 and w1 and the metrics registry their gauges are scraped from."""
    workers = WorkerRegistry(BreakerConfig())
    for name in ("w0", "w1"):
        workers.add(WorkerSpec(name=name, url=f"http://127.0.0.1:1/{name}"))
    metrics = RouterMetrics()
    metrics.attach_state(workers, None, None, cpu_tier_tokens_per_s=configured)
    return workers, metrics.registry


def gauges(registry: CollectorRegistry, name: str) -> dict[str, float | None]:
    return {w: registry.get_sample_value(name, {"worker": w}) for w in ("w0", "w1")}


def test_the_metrics_export_each_workers_priced_rate_and_whether_it_is_learned() -> None:
    workers, registry = fleet(CONFIGURED)
    assert gauges(registry, RATE) == {"w0": CONFIGURED, "w1": CONFIGURED}
    assert gauges(registry, LEARNED) == {"w0": 0.0, "w1": 0.0}
    w0 = workers.get("w0")
    assert w0 is not None
    w0.load.cpu_tier, _ = warmed(50_000.0, MIN_LOADS)
    assert w0.load.cpu_tier.learned is not None  # 3 loads of 1,000 tokens: enough
    got = gauges(registry, RATE)
    assert got["w0"] == pytest.approx(50_000.0) and got["w1"] == CONFIGURED
    assert gauges(registry, LEARNED) == {"w0": 1.0, "w1": 0.0}
    # the rate priced, not the one measured: bounded around the configured one
    w0.load.cpu_tier, _ = warmed(1e12, MIN_LOADS)
    assert gauges(registry, RATE)["w0"] == pytest.approx(CONFIGURED * BOUND)
    assert gauges(registry, LEARNED)["w0"] == 1.0


def test_a_removed_workers_cpu_tier_series_go_with_it() -> None:
    workers, registry = fleet(CONFIGURED)
    w1 = workers.get("w1")
    assert w1 is not None
    w1.load.cpu_tier, _ = warmed(50_000.0, 5)
    workers.remove("w1")
    assert gauges(registry, RATE) == {"w0": CONFIGURED, "w1": None}
    assert gauges(registry, LEARNED) == {"w0": 0.0, "w1": None}


def test_without_learning_no_cpu_tier_series_are_exported() -> None:
    _, registry = fleet(None)
    assert gauges(registry, RATE) == {"w0": None, "w1": None}
    assert gauges(registry, LEARNED) == {"w0": None, "w1": None}
