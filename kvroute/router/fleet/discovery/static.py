"""Workers from a fixed list (the router config's `workers:` or the command line)."""

from __future__ import annotations

from collections.abc import Iterable

from kvroute.router.fleet.discovery.sink import DiscoverySink, DiscoveryStats, SourceView
from kvroute.router.fleet.discovery.spec import WorkerSpec


class StaticSource:
    """Announces a fixed set of workers once; `stop()` drains them."""

    def __init__(self, sink: DiscoverySink, workers: Iterable[WorkerSpec]) -> None:
        self.stats = DiscoveryStats(source="static")
        self._workers = list(workers)
        self._view = SourceView(sink, self.stats, max_workers=max(1, len(self._workers)))

    def start(self) -> None:
        """Upsert every worker of the list."""
        self._view.replace_all(self._workers)

    def stop(self) -> None:
        """Drain every worker this source announced."""
        self._view.clear()
