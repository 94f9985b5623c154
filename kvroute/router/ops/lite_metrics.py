"""Counters and histograms cheap enough for the proxy's hot path.

prometheus-client's own metrics take a lock per update and look labels up in Python on every
`labels()` call: about 10 % of the router's CPU per request. These keep plain numbers on
cached label children (everything runs on the event loop thread) and turn them into the same
Prometheus families at scrape time: the same names, labels, buckets and text format
(`name_total`; `name_bucket`/`_sum`/`_count`), without the `_created` series.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        self.value += amount


class HistogramChild:
    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self._bounds, value)] += 1
        self.sum += value


class LiteFamily(Collector):
    """Label children of one family, kept as plain numbers and exported at scrape time."""

    def __init__(
        self, name: str, doc: str, labelnames: Sequence[str], registry: CollectorRegistry | None
    ) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        if registry is not None:
            registry.register(self)

    def _child(self, values: tuple[str, ...]) -> object:
        key = tuple(map(str, values))
        found = self._children.get(key)
        if found is None:
            if len(key) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {key}")
            found = self._children[key] = self._new()
        return found

    def _new(self) -> object:
        raise NotImplementedError

    def remove_where(self, label: str, keep: Callable[[str], bool]) -> int:
        """Drop every series whose `label` value `keep` rejects; returns how many went.
        A child a caller still holds keeps counting but is no longer exported."""
        at = self.labelnames.index(label)
        gone = [key for key in self._children if not keep(key[at])]
        for key in gone:
            del self._children[key]
        return len(gone)


class LiteCounter(LiteFamily):
    """A counter family; `labels(...)` returns a cached child (no labels: use `inc`)."""

    def __init__(
        self,
        name: str,
        doc: str,
        labelnames: Sequence[str] = (),
        registry: CollectorRegistry | None = None,
    ) -> None:
        super().__init__(name, doc, labelnames, registry)
        self._solo = CounterChild() if not self.labelnames else None
        if self._solo is not None:
            self._children[()] = self._solo

    def _new(self) -> CounterChild:
        return CounterChild()

    def labels(self, *values: str) -> CounterChild:
        found = self._children.get(values)
        return found if found is not None else self._child(values)  # type: ignore[return-value]

    def inc(self, amount: float = 1.0) -> None:
        if self._solo is None:
            raise ValueError(f"{self.name} has labels: use labels(...).inc()")
        self._solo.inc(amount)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
        for values, child in list(self._children.items()):
            family.add_metric(values, child.value)  # type: ignore[attr-defined]
        yield family


class LiteHistogram(LiteFamily):
    """A histogram family with fixed buckets (`le` inclusive, +Inf added)."""

    def __init__(
        self,
        name: str,
        doc: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = (),
        registry: CollectorRegistry | None = None,
    ) -> None:
        bounds = tuple(sorted(float(b) for b in buckets if b != float("inf")))
        if not bounds:
            raise ValueError("a histogram needs buckets")
        self._bounds = bounds
        self._le = [floatToGoString(b) for b in bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        super().__init__(name, doc, labelnames, registry)
        self._solo = HistogramChild(bounds) if not self.labelnames else None
        if self._solo is not None:
            self._children[()] = self._solo

    def _new(self) -> HistogramChild:
        return HistogramChild(self._bounds)

    def labels(self, *values: str) -> HistogramChild:
        found = self._children.get(values)
        return found if found is not None else self._child(values)  # type: ignore[return-value]

    def observe(self, value: float) -> None:
        if self._solo is None:
            raise ValueError(f"{self.name} has labels: use labels(...).observe()")
        self._solo.observe(value)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        for values, child in list(self._children.items()):
            assert isinstance(child, HistogramChild)
            total = 0
            buckets = []
            for le, n in zip(self._le, child.counts, strict=True):
                total += n
                buckets.append((le, float(total)))
            family.add_metric(values, buckets, child.sum)
        yield family
