"""The two timings the fleet-scale benchmark reads from a router: how old a batch is when it
is applied (engine timestamp to apply), and a decision's time with the index scoring in it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence

from kvroute.router.config import BreakerConfig, EventsConfig, WorkerSpec
from kvroute.router.fleet.event_subscriptions import EventSubscriptions
from kvroute.router.fleet.workers import WorkerRegistry
from kvroute.router.ops.metrics import RouterMetrics
from tests.router.fakes import ScriptedIndex
from tests.router.harness import rig
from tests.router.test_events import FakeBridge, batch, until

SCORING_S = 0.03


def test_event_lag_is_engine_timestamp_to_apply() -> None:
    async def go() -> None:
        bridge = FakeBridge()
        await bridge.start()
        index = ScriptedIndex()
        metrics = RouterMetrics()
        events = EventSubscriptions(index, EventsConfig(apply_delay_s=0), metrics)
        registry = WorkerRegistry(BreakerConfig())
        registry.listen(events)
        registry.add(
            WorkerSpec(name="w0", url="http://127.0.0.1:1", bridge=f"127.0.0.1:{bridge.port}")
        )
        await events.start()
        try:
            await until(lambda: "w0" not in events.unusable())
            old = batch(1, 0)
            old.timestamp = time.time() - 0.5  # published half a second ago
            bridge.stream.apply(old)
            bridge.stream.apply(batch(2, 16))  # timestamp 0: an engine that gave none
            await until(lambda: len(index.batches) == 2)
        finally:
            await events.stop()
            await bridge.stop()
        sample = metrics.registry.get_sample_value
        assert sample("kvroute_event_lag_seconds_count") == 1  # the one with a timestamp
        lag = sample("kvroute_event_lag_seconds_sum")
        assert lag is not None and 0.5 <= lag < 5.0
        assert sample("kvroute_event_lag_seconds_bucket", {"le": "0.25"}) == 0
        assert sample("kvroute_event_lag_seconds_bucket", {"le": "1.0"}) == 1

    asyncio.run(go())


class SlowIndex(ScriptedIndex):
    """Scoring takes SCORING_S (as a long prompt over a large fleet does)."""

    def reach(
        self,
        token_ids: Sequence[int],
        lora_name: str = "",
        cache_salt: str = "",
        keys: Sequence[int] | None = None,
    ) -> tuple[Mapping[str, int | None], Mapping[str, int]]:
        time.sleep(SCORING_S)
        return super().reach(token_ids, lora_name, cache_salt, keys)

    def explain(self, token_ids, lora_name="", cache_salt="", keys=None):  # type: ignore[no-untyped-def]
        time.sleep(SCORING_S)
        return super().explain(token_ids, lora_name, cache_salt, keys)


def test_decision_time_counts_the_index_scoring() -> None:
    async def go() -> None:
        index = SlowIndex(scores={"w0": 0, "w1": 0})
        async with rig(2, index=index, models={"m": {"tokenizer": "request"}}) as r:
            body = {"model": "m", "prompt": list(range(1, 257)), "max_tokens": 1}
            resp = await r.client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            sample = r.parts.metrics.registry.get_sample_value
            assert sample("kvroute_routing_decision_seconds_count") == 1
            total = sample("kvroute_routing_decision_seconds_sum")
            assert total is not None and total >= SCORING_S

    asyncio.run(go())
