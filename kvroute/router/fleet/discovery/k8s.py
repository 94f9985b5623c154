"""Workers from Kubernetes: list pods by label selector, then watch them.

The usual informer loop, without a cache of whole pods (only the announced workers):
list, announce the ready pods and drain the rest, then watch from the list's
resourceVersion. A stream that ends or breaks is resumed from the last resourceVersion seen
(events and BOOKMARKs); 410 Gone or a malformed event means that position is lost, so the
source lists again and reconciles: pods that vanished in between are drained.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from typing import Protocol

from kvroute.ratelog import RateLimitedLog
from kvroute.router.fleet.discovery.kube_client import (
    ApiError,
    Gone,
    MalformedEvent,
    PodList,
    WatchEvent,
)
from kvroute.router.fleet.discovery.pods import PodDefaults, pod_name, worker_from_pod
from kvroute.router.fleet.discovery.sink import DiscoverySink, DiscoveryStats, SourceView
from kvroute.router.fleet.discovery.spec import WorkerSpec, WorkerSpecError

log = logging.getLogger(__name__)


class PodClient(Protocol):
    """What the source needs from the API (KubePodClient implements it)."""

    async def list_pods(self) -> PodList: ...

    def watch_pods(self, resource_version: str) -> AsyncGenerator[WatchEvent, None]: ...

    async def close(self) -> None: ...


def _resource_version(obj: Mapping[str, object]) -> str | None:
    meta = obj.get("metadata")
    if isinstance(meta, Mapping):
        rv = meta.get("resourceVersion")
        if isinstance(rv, str) and rv:
            return rv
    return None


class KubernetesSource:
    """Keeps the sink in step with the ready pods that match the client's selector."""

    def __init__(
        self,
        sink: DiscoverySink,
        client: PodClient,
        *,
        defaults: PodDefaults | None = None,
        max_workers: int = 4096,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
    ) -> None:
        self.stats = DiscoveryStats(source="kubernetes")
        self._client = client
        self._defaults = defaults or PodDefaults()
        self._view = SourceView(sink, self.stats, max_workers=max_workers)
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._random = random.Random()
        self._log = RateLimitedLog(log)
        self.resource_version: str | None = None  # where the next watch starts
        self.synced = asyncio.Event()  # set after the first successful list

    async def run(self) -> None:
        """List and watch until cancelled. Never returns on API errors: it backs off."""
        backoff = self._backoff_initial
        while True:
            try:
                if self.resource_version is None:
                    await self._relist()
                assert self.resource_version is not None
                async with aclosing(self._client.watch_pods(self.resource_version)) as events:
                    async for event in events:
                        self._apply(event)
                        backoff = self._backoff_initial
                # The server ended the stream (its timeout, or a clean close): resume.
                self.stats.reconnects += 1
            except Gone as err:
                self.stats.gone += 1
                self._log.warning("gone", "kubernetes watch: %s; listing again", err)
                self.resource_version = None
            except MalformedEvent as err:
                self.stats.errors += 1
                self._log.warning("malformed", "kubernetes watch: %s; listing again", err)
                self.resource_version = None
            except ApiError as err:
                self.stats.errors += 1
                self._log.warning("api", "kubernetes discovery: %s; retrying", err)
                # Full jitter, so replicas do not hammer the API server in step.
                await asyncio.sleep(self._random.uniform(backoff / 2, backoff))
                backoff = min(backoff * 2, self._backoff_max)
                if self.resource_version is not None:
                    self.stats.reconnects += 1

    def drain_all(self) -> None:
        """Drain every worker this source announced."""
        self._view.clear()

    async def close_client(self) -> None:
        """Close the API client (after the run task has been cancelled)."""
        await self._client.close()

    async def _relist(self) -> None:
        pods = await self._client.list_pods()
        self.stats.relists += 1
        wanted: list[WorkerSpec] = []
        for pod in pods.items:
            spec = self._spec(pod)
            if spec is not None:
                wanted.append(spec)
        if len(wanted) > self._view.max_workers:
            self.stats.rejected += len(wanted) - self._view.max_workers
            wanted = wanted[: self._view.max_workers]
        self._view.replace_all(wanted)
        self.resource_version = pods.resource_version
        self.synced.set()

    def _apply(self, event: WatchEvent) -> None:
        rv = _resource_version(event.object)
        if event.type == "BOOKMARK":
            if rv is None:
                raise MalformedEvent("BOOKMARK without metadata.resourceVersion")
            self.resource_version = rv
            return
        name = pod_name(event.object)
        if name is None or event.type not in ("ADDED", "MODIFIED", "DELETED"):
            raise MalformedEvent(f"{event.type} event without a usable pod")
        if event.type == "DELETED":
            self._view.remove(name)
        else:
            spec = self._spec(event.object)
            if spec is None:
                self._view.remove(name)
            elif not self._view.set(spec):
                self._log.warning(
                    "max_workers", "kubernetes discovery: at max_workers, %s not added", name
                )
        if rv is not None:
            self.resource_version = rv

    def _spec(self, pod: Mapping[str, object]) -> WorkerSpec | None:
        """The ready worker a pod stands for; None if not ready or unusable (counted)."""
        try:
            return worker_from_pod(pod, self._defaults)
        except WorkerSpecError as err:
            self.stats.errors += 1
            name = pod_name(pod) or "?"
            self._log.warning("pod:" + name, "kubernetes discovery: pod %s ignored: %s", name, err)
            return None
