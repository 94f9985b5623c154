"""The router's cheap counters and histograms expose exactly what prometheus-client's would."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvroute.router.ops.lite_metrics import LiteCounter, LiteHistogram

BUCKETS = (0.001, 0.01, 0.1, 1, 10)


def exposition(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if "_created" not in line]


observations = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.floats(min_value=0, max_value=100, allow_nan=False) | st.sampled_from(BUCKETS),
    ),
    max_size=40,
)


@settings(max_examples=100, deadline=None)
@given(observations)
def test_same_text_as_prometheus_client(obs: list[tuple[str, float]]) -> None:
    ref, lite = CollectorRegistry(), CollectorRegistry()
    c_ref = Counter("x_events", "Events", ["worker"], registry=ref)
    h_ref = Histogram("x_seconds", "Time", ["worker"], buckets=BUCKETS, registry=ref)
    n_ref = Counter("x_plain", "No labels", registry=ref)
    c = LiteCounter("x_events", "Events", ["worker"], registry=lite)
    h = LiteHistogram("x_seconds", "Time", ["worker"], buckets=BUCKETS, registry=lite)
    n = LiteCounter("x_plain", "No labels", registry=lite)
    for worker, value in obs:
        c_ref.labels(worker).inc(value)
        c.labels(worker).inc(value)
        h_ref.labels(worker).observe(value)
        h.labels(worker).observe(value)
        n_ref.inc()
        n.inc()
    assert exposition(lite) == exposition(ref)


def test_children_are_cached_and_labels_checked() -> None:
    c = LiteCounter("y_total_things", "Things", ["a", "b"])
    assert c.labels("1", "2") is c.labels("1", "2")
    c.labels(1, 2).inc()  # type: ignore[arg-type]  # non-strings are stringified, one child
    assert c.labels("1", "2").value == 1
    with pytest.raises(ValueError):
        c.labels("only-one")
    with pytest.raises(ValueError):
        c.labels("1", "2").inc(-1)
    with pytest.raises(ValueError):
        c.inc()  # has labels
    with pytest.raises(ValueError):
        LiteHistogram("z", "no buckets", buckets=())


def test_remove_where_drops_only_the_rejected_series() -> None:
    registry = CollectorRegistry()
    counter = LiteCounter("c", "doc", ["worker", "outcome"], registry=registry)
    hist = LiteHistogram("h", "doc", ["worker"], buckets=BUCKETS, registry=registry)
    for worker in ("ns/a", "b"):
        counter.labels(worker, "2xx").inc()
        counter.labels(worker, "5xx").inc()
        hist.labels(worker).observe(0.5)
    assert counter.remove_where("worker", lambda w: w != "ns/a") == 2
    assert hist.remove_where("worker", lambda w: w != "ns/a") == 1
    text = "\n".join(exposition(registry))
    assert 'worker="ns/a"' not in text
    assert 'c_total{outcome="5xx",worker="b"} 1.0' in text and 'h_count{worker="b"} 1.0' in text
    counter.labels("ns/a", "2xx").inc()  # a new series starts from zero
    assert 'c_total{outcome="2xx",worker="ns/a"} 1.0' in "\n".join(exposition(registry))
