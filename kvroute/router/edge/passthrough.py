"""Small endpoints that need no routing decision: /tokenize and /detokenize (forwarded to a
worker serving the model), /v1/models (aggregated from the fleet) and /health."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvroute.ratelog import RateLimitedLog
from kvroute.router.edge.body import BodyReader, ClientGone
from kvroute.router.edge.errors import (
    NO_WORKER,
    POOL_WAIT,
    UNKNOWN_MODEL,
    UPSTREAM,
    UPSTREAM_TIMEOUT,
    RouterError,
    error_response,
)
from kvroute.router.edge.json_input import decode_object
from kvroute.router.edge.openai_request import forward_headers
from kvroute.router.edge.trust import TrustedPeers, peer_of
from kvroute.router.edge.upstream import (
    Upstream,
    UpstreamConnectError,
    UpstreamPoolTimeout,
    UpstreamTimeout,
)
from kvroute.router.fleet.workers import Worker, WorkerRegistry
from kvroute.router.ops.metrics import RouterMetrics

log = logging.getLogger("kvroute.router.passthrough")

_KEEP_RESPONSE_HEADERS = (b"content-type",)


class Passthrough:
    def __init__(
        self,
        registry: WorkerRegistry,
        upstream: Upstream,
        metrics: RouterMetrics,
        bodies: BodyReader,
        retry_after_s: int,
        clock: Callable[[], float] = time.monotonic,
        trusted: TrustedPeers | None = None,
    ) -> None:
        self._registry = registry
        self._upstream = upstream
        self._metrics = metrics
        self._bodies = bodies
        self._trusted = trusted or TrustedPeers(())
        self._retry_after = retry_after_s
        self._clock = clock
        self._ratelog = RateLimitedLog(log, interval_s=10.0)

    async def forward(self, request: Request) -> Response:
        """POST the body to the least busy eligible worker serving the body's model."""
        path = request.url.path
        lease = self._bodies.lease()
        try:
            raw = await self._bodies.read(request.scope["headers"], request.receive, lease)
            body = decode_object(raw)
            worker = self._pick(body.get("model"))
            try:
                resp = await self._upstream.send(
                    "POST",
                    worker.url + path,
                    forward_headers(
                        request.scope["headers"], peer_of(request.scope) in self._trusted
                    ),
                    raw,
                )
                data = await resp.read()
                resp.release()
            except UpstreamPoolTimeout as exc:
                raise RouterError(POOL_WAIT, str(exc), retry_after=self._retry_after) from None
            except UpstreamTimeout as exc:
                raise RouterError(UPSTREAM_TIMEOUT, f"{worker.name}: {exc}") from None
            except UpstreamConnectError as exc:
                raise RouterError(UPSTREAM, f"{worker.name}: {exc}") from None
            headers = {
                k.decode("latin-1"): v.decode("latin-1")
                for k, v in resp.headers
                if k in _KEEP_RESPONSE_HEADERS
            }
            self._metrics.requests.labels(path, str(resp.status)).inc()
            return Response(data, resp.status, headers=headers)
        except RouterError as exc:
            self._metrics.errors.labels(exc.kind.kind).inc()
            self._metrics.requests.labels(path, str(exc.kind.status)).inc()
            self._ratelog.warning(exc.kind.kind, "%s %s: %s", exc.kind.status, path, exc.message)
            return error_response(exc)
        except ClientGone:
            self._metrics.disconnects.inc()
            return Response(b"", 499)
        finally:
            lease.release()

    def _pick(self, model: object) -> Worker:
        now = self._clock()
        if isinstance(model, str) and model:
            if self._registry.route(model) is None:
                raise RouterError(UNKNOWN_MODEL, f"The model `{model}` does not exist.")
            pool = self._registry.serving(model)
        else:
            pool = list(self._registry)
        ready = [w for w in pool if w.takes_requests(now)]
        if not ready:
            raise RouterError(NO_WORKER, "no healthy worker", retry_after=self._retry_after)
        return min(ready, key=lambda w: w.load.running)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": self._registry.model_cards()})

    async def health(self, request: Request) -> Response:
        now = self._clock()
        ready = sum(1 for w in self._registry if w.takes_requests(now) and w.serves())
        status = 200 if ready else 503
        return JSONResponse(
            {"status": "ok" if ready else "no_ready_worker", "ready_workers": ready}, status
        )
