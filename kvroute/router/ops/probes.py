"""Kubernetes probes: `/livez` (the process serves) and `/readyz` (it can route).

Liveness must not depend on the fleet: a router restarted during a fleet outage loses its
index and its learned load for nothing. Readiness asks that every model the router was told
about (the `models:` section, static workers' `model`) and every base model the fleet
announced has at least one worker taking requests. `/health` keeps its older meaning (at
least one ready worker) for clients that use it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvroute.router.fleet.workers import WorkerRegistry


class Probes:
    def __init__(
        self,
        registry: WorkerRegistry,
        configured_models: Iterable[str],
        clock: Callable[[], float] = time.monotonic,
        index_ready: Callable[[], bool] | None = None,
    ) -> None:
        self._registry = registry
        self._index_ready = index_ready
        self._configured = frozenset(configured_models)
        self._clock = clock

    def routes(self) -> list[Route]:
        return [
            Route("/livez", self.livez, methods=["GET"]),
            Route("/readyz", self.readyz, methods=["GET"]),
        ]

    async def livez(self, request: Request) -> Response:
        """200 while the event loop answers; nothing else is consulted."""
        return JSONResponse({"status": "ok"})

    def unready_models(self) -> tuple[int, list[str]]:
        """(workers taking requests, models expected but without any such worker)."""
        now = self._clock()
        ready_models: set[str] = set()
        known: set[str] = set(self._configured)
        ready = 0
        for worker in self._registry:
            served = worker.serves()
            for name in served:
                route = self._registry.route(name)
                if route is not None and not route.lora_name:
                    known.add(name)
            if served and worker.takes_requests(now):
                ready += 1
                ready_models |= served
        return ready, sorted(known - ready_models)

    async def readyz(self, request: Request) -> Response:
        """200 when at least one worker is ready and every expected model has one (and,
        with index shard processes, every shard answers); else 503."""
        ready, missing = self.unready_models()
        ok = ready > 0 and not missing
        body: dict[str, object] = {
            "ready_workers": ready,
            "models_without_ready_worker": missing,
        }
        if self._index_ready is not None:
            index_up = self._index_ready()
            body["index"] = "up" if index_up else "down"
            ok = ok and index_up
        return JSONResponse({"status": "ok" if ok else "not_ready", **body}, 200 if ok else 503)
