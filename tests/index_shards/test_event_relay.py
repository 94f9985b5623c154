"""The shards' `kvroute_event_*` series relayed into the router's /metrics: summed over
shards, carried across a shard's restart (the router's counters never go down), under the
names and buckets of the in-process families, which the router no longer exports itself."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvroute.router.config import BreakerConfig, WorkerSpec
from kvroute.router.fleet.workers import WorkerRegistry
from kvroute.router.index_shards import wire
from kvroute.router.index_shards.client import ShardedIndexView
from kvroute.router.index_shards.control import ShardedEvents
from kvroute.router.index_shards.server import Shard, ShardSettings
from kvroute.router.ops.metrics import RouterMetrics, family_series

LAG = "kvroute_event_lag_seconds"


def samples(metrics: RouterMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def shard_metrics(lags: list[float], batches: dict[str, int]) -> RouterMetrics:
    """A shard's own metrics after observing these lags and per-worker batches."""
    m = RouterMetrics()
    for x in lags:
        m.event_lag_seconds.observe(x)
    for name, n in batches.items():
        m.event_batches.labels(name).inc(n)
    return m


def answer(generation: int, m: RouterMetrics) -> wire.StatusAnswer:
    series = [wire.Series(n, list(lb), v) for (n, lb), v in family_series(m.event_families())]
    sent = wire.StatusAnswer(1, 0, generation, [], series)
    got = wire.decode_from_shard(wire.frame(sent)[wire.HEADER.size :])  # as it travels
    assert isinstance(got, wire.StatusAnswer)
    return got


Router = tuple[RouterMetrics, ShardedEvents, WorkerRegistry]


@pytest.fixture
def router() -> Router:
    """A router's metrics and shard event feed (no shard connected: answers are applied as
    the control loop applies them)."""
    metrics = RouterMetrics()
    paths = ["/nonexistent/a", "/nonexistent/b"]
    view = ShardedIndexView(paths, registry=metrics.registry)
    events = ShardedEvents(view, paths, registry=metrics.registry)
    workers = WorkerRegistry(BreakerConfig())
    workers.listen(events)
    metrics.attach_state(workers, view, events)
    return metrics, events, workers


def test_the_shards_series_are_summed_under_the_in_process_names(
    router: Router,
) -> None:
    metrics, events, _ = router
    c0, c1 = events._controls
    metrics.event_lag_seconds.observe(100.0)  # this process's own family is no longer exported
    events._apply_status(c0, answer(0, shard_metrics([0.003, 0.2], {"w0": 3})))
    events._apply_status(c1, answer(0, shard_metrics([0.003, 7.0], {"w1": 5})))
    s = samples(metrics)
    assert s[(LAG + "_count", ())] == 4
    assert s[(LAG + "_sum", ())] == pytest.approx(0.003 + 0.2 + 0.003 + 7.0)
    assert s[(LAG + "_bucket", (("le", "0.005"),))] == 2
    assert s[(LAG + "_bucket", (("le", "0.25"),))] == 3
    assert s[(LAG + "_bucket", (("le", "10.0"),))] == 4
    assert s[("kvroute_event_batches_total", (("worker", "w0"),))] == 3
    assert s[("kvroute_event_batches_total", (("worker", "w1"),))] == 5
    text = generate_latest(metrics.registry).decode()
    assert text.count(f"# TYPE {LAG} histogram") == 1  # once, not the idle family as well


def test_a_restarted_shard_adds_to_what_it_counted_before(router: Router) -> None:
    metrics, events, workers = router
    workers.add(WorkerSpec(name="w0", url="http://127.0.0.1:1", bridge="127.0.0.1:2"))
    c0 = events._controls[events._view.owner("w0")]
    events._apply_status(c0, answer(0, shard_metrics([0.01] * 4, {"w0": 4})))
    events._apply_status(c0, answer(0, shard_metrics([0.01] * 6, {"w0": 6})))  # grew
    assert samples(metrics)[(LAG + "_count", ())] == 6
    events._apply_status(c0, answer(1, shard_metrics([0.01], {"w0": 1})))  # restarted
    s = samples(metrics)
    assert s[(LAG + "_count", ())] == 7
    assert s[("kvroute_event_batches_total", (("worker", "w0"),))] == 7
    # a worker removed: its earlier generations' series go with it
    workers.remove("w0")
    events._apply_status(c0, answer(1, shard_metrics([0.01], {})))
    assert ("kvroute_event_batches_total", (("worker", "w0"),)) not in samples(metrics)


def test_series_that_do_not_fit_their_family_are_left_out(router: Router) -> None:
    metrics, events, _ = router
    bad = [
        wire.Series(LAG, [], [1.0, 2.0]),  # wrong bucket count
        wire.Series("kvroute_event_batches", [], [3.0]),  # missing its worker label
        wire.Series("kvroute_event_stream_lost", ["w0"], [1.0]),
    ]
    events._apply_status(events._controls[0], wire.StatusAnswer(1, 0, 0, [], bad))
    s = samples(metrics)
    assert s[(LAG + "_count", ())] == 0
    assert not any(name == "kvroute_event_batches_total" for name, _ in s)
    assert s[("kvroute_event_stream_lost_total", (("worker", "w0"),))] == 1


def test_a_status_answer_carries_a_bounded_number_of_series() -> None:
    too_many = [["kvroute_event_batches", ["w"], [1.0]]] * (wire.MAX_SERIES + 1)
    body = msgspec.msgpack.encode(
        {"type": "StatusAnswer", "id": 1, "shard": 0, "generation": 0, "workers": [],
         "series": too_many}
    )  # fmt: skip
    with pytest.raises(wire.WireError):
        wire.decode_from_shard(body)


def test_the_shard_answers_with_its_event_series_and_forgets_a_dropped_worker() -> None:
    shard = Shard(ShardSettings())
    shard.metrics.event_lag_seconds.observe(0.02)
    shard.metrics.event_batches.labels("w0").inc(2)
    got = {(s.family, tuple(s.labels)): s.values for s in shard.status(1).series}
    assert got[(LAG, ())][-1] == pytest.approx(0.02)
    assert sum(got[(LAG, ())][:-1]) == 1
    assert got[("kvroute_event_batches", ("w0",))] == [2.0]
    shard._drop("w0")
    assert ("kvroute_event_batches", ("w0",)) not in {
        (s.family, tuple(s.labels)) for s in shard.status(2).series
    }
