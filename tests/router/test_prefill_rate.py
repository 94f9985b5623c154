"""The learned prefill rate: least squares over a bounded window, guarded, used by the policy."""

from __future__ import annotations

import random

import pytest

from kvroute.router.config import PolicyConfig
from kvroute.router.fleet.load import PrefillRateEstimate
from kvroute.router.routing.policy import LoadModel


def test_learns_the_rate_despite_a_constant_overhead_and_noise() -> None:
    rng = random.Random(3)
    est = PrefillRateEstimate(20_000.0, window=256, min_samples=32)
    for _ in range(400):
        tokens = rng.randint(100, 8000)
        # 5,000 tokens/s plus 30 ms of step overhead, +-10% noise
        est.observe(tokens, (0.03 + tokens / 5000.0) * rng.uniform(0.9, 1.1))
    assert est.value == pytest.approx(5000.0, rel=0.08)


def test_keeps_the_configured_rate_until_enough_spread_samples() -> None:
    est = PrefillRateEstimate(20_000.0, window=64, min_samples=32)
    for _ in range(31):
        est.observe(1000, 0.2)
    assert est.value == 20_000.0  # too few samples
    for _ in range(100):
        est.observe(1000, 0.2)
    assert est.value == 20_000.0  # every sample the same size: no slope to fit
    for bad in ((0, 0.1), (500, 0.0), (500, -1.0), (500, 1e9)):
        est.observe(*bad)
    assert est.value == 20_000.0


def test_a_window_forgets_old_samples() -> None:
    est = PrefillRateEstimate(20_000.0, window=100, min_samples=20)
    for i in range(100):
        tokens = 200 + 50 * i
        est.observe(tokens, tokens / 2000.0)
    assert est.value == pytest.approx(2000.0, rel=1e-6)
    for i in range(100):  # the GPU got 4x faster: after a full window only the new rate counts
        tokens = 200 + 50 * i
        est.observe(tokens, tokens / 8000.0)
    assert est.value == pytest.approx(8000.0, rel=1e-6)
    assert len(est._samples) == 100  # bounded


def test_a_wild_fit_is_clamped_and_a_negative_slope_ignored() -> None:
    est = PrefillRateEstimate(10_000.0, window=64, min_samples=8)
    for i in range(64):
        est.observe(100 + 10 * i, 1.0 - i * 0.01)  # bigger prompts faster: slope < 0
    assert est.value == 10_000.0
    for i in range(64):
        est.observe(100 + 10 * i, 1.0 + i * 1e-9)  # practically flat: an absurd rate
    assert est.value == 10_000.0 * 100


def test_the_load_model_converts_with_the_learned_rate() -> None:
    cfg = PolicyConfig(prefill_tokens_per_s=20_000.0)
    rate = {"v": 20_000.0}
    model = LoadModel(cfg, lambda: 1000.0, 5.0, lambda: rate["v"])
    assert model.seconds_per_token() == pytest.approx(1 / 20_000)
    rate["v"] = 5_000.0
    assert model.seconds_per_token() == pytest.approx(1 / 5_000)
    fixed = LoadModel(cfg, lambda: 1000.0, 5.0)
    assert fixed.seconds_per_token() == pytest.approx(1 / 20_000)


def test_an_estimate_at_the_configured_rate_converts_to_wall_time_at_the_measured_one() -> None:
    est = PrefillRateEstimate(20_000.0, window=64, min_samples=8)
    assert est.wall_seconds(0.2, 20_000.0) == pytest.approx(0.2)  # no fit yet: unchanged
    for i in range(64):
        tokens = 500 + 100 * i
        est.observe(tokens, tokens / 5000.0)  # the fleet prefills 4x slower than configured
    # 4,000 tokens estimated at 0.2 s take 0.8 s here
    assert est.wall_seconds(0.2, 20_000.0) == pytest.approx(0.8, rel=1e-6)
