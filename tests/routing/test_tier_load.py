"""The `tier_load` term: GPU tokens free, lower-tier tokens at their tier's load rate, the rest
prefilled; off (and decisions unchanged) without lower tiers."""

from __future__ import annotations

import pytest

from kvroute.router.config import PolicyConfig
from kvroute.router.routing.index_view import TierReuse
from kvroute.router.routing.policy import CACHE, LEAST_LOAD, LoadModel, RouteInput, make_policy
from kvroute.router.routing.records import Candidate, Decision
from tests.router.test_policy import fleet

N = 8000


def decide(req: RouteInput, **cfg: float) -> tuple[Decision, dict[str, Candidate], PolicyConfig]:
    config = PolicyConfig(**cfg)  # type: ignore[arg-type]
    policy = make_policy(config, LoadModel(config, lambda: 1000.0, 5.0))
    d = policy.decide(fleet(3), req, 0.0)
    return d, {c.name: c for c in d.candidates}, config


def test_tokens_are_priced_by_where_the_worker_gets_them() -> None:
    reuse = {"w0": 0, "w1": 1024, "w2": 7000}
    tiers = {"w0": TierReuse(cpu=6000, storage=1000), "w1": TierReuse(storage=4000)}
    d, by, cfg = decide(RouteInput(N, reuse, None, tiers=tiers))
    s = 1 / cfg.prefill_tokens_per_s
    cpu, storage = 1 / cfg.cpu_tier_tokens_per_s, 1 / cfg.storage_tier_tokens_per_s
    w0, w1, w2 = by["w0"], by["w1"], by["w2"]
    assert (w0.cpu_tokens, w0.storage_tokens, w0.uncached) == (6000, 1000, 1000)
    assert w0.terms["prefill"] == pytest.approx(1000 * s)
    assert w0.terms["tier_load"] == pytest.approx(6000 * cpu + 1000 * storage)
    assert w1.terms["tier_load"] == pytest.approx(4000 * storage)
    assert w1.terms["prefill"] == pytest.approx((N - 1024 - 4000) * s)
    assert w2.terms["tier_load"] == 0.0 and w2.uncached == 1000
    for c in (w0, w1, w2):
        assert c.est_ttft_s == pytest.approx(sum(v for k, v in c.terms.items() if k != "junction"))
    # w2 holds 7000 on GPU, w0 7000 in lower tiers: the GPU copy wins by the transfer
    assert d.chosen is w2 and d.reason == CACHE
    assert w0.est_ttft_s - w2.est_ttft_s == pytest.approx(6000 * cpu + 1000 * storage)
    assert d.predicted_reuse == 7000


def test_a_cpu_copy_beats_a_cold_worker_and_the_decision_says_so() -> None:
    reuse: dict[str, int | None] = {"w0": 0, "w1": 0, "w2": 0}
    d, by, _ = decide(RouteInput(N, reuse, "s", tiers={"w1": TierReuse(cpu=7936)}))
    assert d.chosen is by["w1"] and d.reason == CACHE  # not the cold session hash
    assert d.predicted_reuse == 7936  # vLLM reports CPU-loaded tokens as cached
    assert "loading 7936 from CPU and 0 from storage" in d.detail
    assert by["w1"].predicted_cached == 7936 and by["w0"].predicted_cached == 0
    # the same request without the tier has no evidence: the cold path
    d, _, _ = decide(RouteInput(N, reuse, None))
    assert d.reason == LEAST_LOAD


def test_slower_tiers_cost_more_and_the_rate_is_configurable() -> None:
    reuse = {"w0": 0, "w1": 0, "w2": 0}
    tiers = {"w0": TierReuse(cpu=4000), "w1": TierReuse(storage=4000)}
    d, by, _ = decide(RouteInput(N, reuse, None, tiers=tiers))
    assert by["w0"].terms["tier_load"] < by["w1"].terms["tier_load"] and d.chosen is by["w0"]
    # with storage as fast as CPU the two are equal; slower than prefill it loses to cold
    _, by, _ = decide(
        RouteInput(N, reuse, None, tiers=tiers),
        storage_tier_tokens_per_s=200_000.0,
    )
    assert by["w0"].est_ttft_s == pytest.approx(by["w1"].est_ttft_s)
    _, by, _ = decide(RouteInput(N, reuse, None, tiers=tiers), cpu_tier_tokens_per_s=10_000.0)
    assert by["w0"].est_ttft_s > by["w2"].est_ttft_s


def test_the_term_is_off_without_lower_tiers() -> None:
    reuse = {"w0": 100, "w1": 3000, "w2": None}
    plain, by_plain, _ = decide(RouteInput(N, reuse, None))
    empty, by_empty, _ = decide(RouteInput(N, reuse, None, tiers={}))
    for by in (by_plain, by_empty):
        assert all(c.terms["tier_load"] == 0.0 for c in by.values())
    assert [c.est_ttft_s for c in plain.candidates] == [c.est_ttft_s for c in empty.candidates]
    assert plain.detail == empty.detail and "loading" not in plain.detail


def test_a_learned_rate_prices_its_workers_cpu_tokens() -> None:
    reuse = {"w0": 0, "w1": 0, "w2": 0}
    tiers = {"w0": TierReuse(cpu=4000), "w1": TierReuse(cpu=4000, storage=1000)}
    config = PolicyConfig(learn_cpu_tier_rate=True)
    policy = make_policy(config, LoadModel(config, lambda: 1000.0, 5.0))
    workers = fleet(3)
    w0 = workers[0].load.cpu_tier
    w0.observe(0.0, 0.0)
    for i in range(1, 6):  # w0's engine loads at 40k tokens/s; w1 has shown nothing yet
        w0.observe(1000.0 * i, 1000.0 * i / 40_000.0)
    d = policy.decide(workers, RouteInput(N, reuse, None, tiers=tiers), 0.0)
    by = {c.name: c for c in d.candidates}
    storage = 1000 / config.storage_tier_tokens_per_s
    assert by["w0"].terms["tier_load"] == pytest.approx(4000 / 40_000.0)
    assert by["w1"].terms["tier_load"] == pytest.approx(
        4000 / config.cpu_tier_tokens_per_s + storage
    )
    # the setting off: the configured rate for everyone
    _, by, cfg = decide(RouteInput(N, reuse, None, tiers=tiers))
    assert by["w0"].terms["tier_load"] == pytest.approx(4000 / cfg.cpu_tier_tokens_per_s)
