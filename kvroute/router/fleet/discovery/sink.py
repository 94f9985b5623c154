"""The interface discovery talks to, and the per-source bookkeeping in front of it.

Every source (static list, watched file, Kubernetes) owns a `SourceView`: it remembers
which workers that source has announced, tells the sink only about changes, and only ever
drains names it announced itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from kvroute.router.fleet.discovery.spec import WorkerSpec


class DiscoverySink(Protocol):
    """Implemented by the router's worker registry. Calls come from the event loop thread."""

    def upsert(self, worker: WorkerSpec) -> None:
        """Add the worker, or replace the one of the same name (un-draining it)."""

    def drain(self, name: str) -> None:
        """Stop new requests to `name`, let in-flight ones finish, then remove it."""


@dataclass(slots=True)
class DiscoveryStats:
    """Counters of one source, for the router's /metrics."""

    source: str
    upserts: int = 0
    drains: int = 0
    errors: int = 0  # bad input (file, pod annotations, watch events) and API failures
    rejected: int = 0  # workers refused because the source is at max_workers
    relists: int = 0  # full Kubernetes lists (the first one, and after 410 Gone / bad events)
    gone: int = 0  # watches refused with 410 Gone (resourceVersion too old)
    reconnects: int = 0  # watch streams resumed from a resourceVersion
    workers: int = 0  # currently announced, not drained


@dataclass(slots=True)
class SourceView:
    """What one source has told the sink; turns desired states into minimal sink calls."""

    sink: DiscoverySink
    stats: DiscoveryStats
    max_workers: int = 4096
    announced: dict[str, WorkerSpec] = field(default_factory=dict)

    def set(self, spec: WorkerSpec) -> bool:
        """Announce `spec` if new or changed. Returns False when refused at max_workers."""
        current = self.announced.get(spec.name)
        if current == spec:
            return True
        if current is None and len(self.announced) >= self.max_workers:
            self.stats.rejected += 1
            return False
        self.announced[spec.name] = spec
        self.sink.upsert(spec)
        self.stats.upserts += 1
        self.stats.workers = len(self.announced)
        return True

    def remove(self, name: str) -> None:
        """Drain `name` if this source announced it; otherwise nothing."""
        if self.announced.pop(name, None) is None:
            return
        self.sink.drain(name)
        self.stats.drains += 1
        self.stats.workers = len(self.announced)

    def replace_all(self, specs: Iterable[WorkerSpec]) -> None:
        """Make the announced set exactly `specs`: drain the missing, upsert the changed."""
        wanted = {spec.name: spec for spec in specs}
        for name in [n for n in self.announced if n not in wanted]:
            self.remove(name)
        for spec in wanted.values():
            self.set(spec)

    def clear(self) -> None:
        """Drain everything this source announced."""
        for name in list(self.announced):
            self.remove(name)
