"""Verification: predictions against the engines' cached_tokens, tokenizer mismatches, and the
resync of a drifting worker's view (through a real bridge gRPC service on loopback)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvroute.router.config import VerifyConfig
from kvroute.router.fleet.verify import (
    EXACT,
    NOT_REPORTED,
    OVER,
    TOKENIZER_MISMATCH,
    UNDER,
    Verifier,
)
from kvroute.router.ops.metrics import RouterMetrics
from tests.router.harness import rig
from tests.router.test_events import FakeBridge, batch, until


def verifier(**kw: object) -> tuple[Verifier, list[str], list[float]]:
    calls: list[str] = []
    now = [0.0]
    cfg = VerifyConfig(**{"window": 8, "min_samples": 4, "miss_fraction": 0.5, **kw})  # type: ignore[arg-type]
    v = Verifier(cfg, RouterMetrics(), lambda w: calls.append(w) or True, lambda: now[0])
    return v, calls, now


def test_outcomes() -> None:
    v, calls, _ = verifier()
    assert v.observe("w", 32, 32, 40, 40) == EXACT
    assert v.observe("w", 32, 16, 40, 40) == OVER
    assert v.observe("w", 0, 16, 40, 40) == UNDER
    assert v.observe("w", None, 0, 40, 40) == EXACT  # no evidence counts as predicting 0
    assert v.observe("w", 32, 16, 41, 40) == TOKENIZER_MISMATCH
    assert v.observe("w", 32, None, 40, 40) == NOT_REPORTED
    assert v.observe("w", 32, 32, 40, None) == NOT_REPORTED  # no ids, nothing to judge
    acc = v.accuracy("w")
    assert acc is not None and acc.verified == 4 and acc.misses == 2
    assert acc.tokenizer_mismatches == 1 and acc.mean_abs_error() == 8.0
    assert calls == ["w"]  # 2 misses in 4 reaches miss_fraction 0.5
    v2, _, _ = verifier(tolerance_tokens=16)
    assert v2.observe("w", 32, 16, 40, 40) == EXACT  # within tolerance


def test_resync_once_per_episode_with_cooldown(caplog: pytest.LogCaptureFixture) -> None:
    v, calls, now = verifier(resync_cooldown_s=10)
    caplog.set_level(logging.WARNING, "kvroute.router.verify")
    for _ in range(4):
        v.observe("w", 64, 0, 80, 80)
    assert calls == ["w"]
    for _ in range(8):  # still missing, but within the cooldown
        v.observe("w", 64, 0, 80, 80)
    assert calls == ["w"]
    now[0] = 11.0
    for _ in range(4):
        v.observe("w", 64, 0, 80, 80)
    assert calls == ["w", "w"]
    warnings = [r for r in caplog.records if "resynchronising" in r.getMessage()]
    assert len(warnings) == 1  # logged once for the episode, not per resync
    for _ in range(8):
        v.observe("w", 64, 64, 80, 80)
    assert v.accuracy("w").in_episode is False  # type: ignore[union-attr]
    mismatch_only, calls3, _ = verifier()
    for _ in range(10):
        mismatch_only.observe("w", 64, 0, 81, 80)
    assert calls3 == []  # tokenizer mismatches never trigger a resync


def test_drift_resyncs_the_view_from_a_snapshot() -> None:
    async def go() -> None:
        bridge = FakeBridge()
        await bridge.start()
        bridge.stream.apply(batch(1, 0))
        bridges = {"w0": f"127.0.0.1:{bridge.port}"}
        try:
            async with rig(1, bridges=bridges, verify={"window": 4, "min_samples": 4}) as r:
                await until(lambda: len(r.index.snapshots) == 1)
                r.index.scores = {"w0": 20}  # the view claims reuse the engine never has
                body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
                for _ in range(4):
                    assert (
                        await r.client.post("/v1/chat/completions", json=body)
                    ).status_code == 200
                assert r.index.invalidated == ["w0"]
                await until(lambda: len(r.index.snapshots) == 2)  # resubscribed from scratch
                workers = (await r.client.get("/admin/workers", headers=r.admin_headers())).json()[
                    "workers"
                ]
                pred = workers[0]["prediction"]
                assert pred["resyncs"] == 1 and pred["misses"] == 4
                text = (await r.client.get("/metrics")).text
                assert 'kvroute_index_resyncs_total{cause="drift",worker="w0"} 1.0' in text
        finally:
            await bridge.stop()

    asyncio.run(go())
