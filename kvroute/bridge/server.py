"""The gRPC `kvroute.v1.KvEvents` service (grpc.aio, on the bridge's event loop).

Responses are pre-serialized once per batch by `RankStream` and written as bytes to every
subscriber, so fan-out costs no re-serialization.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import grpc
import grpc.aio

from kvroute.bridge.auth import ServerTls, server_credentials, token_matches
from kvroute.bridge.metrics import BridgeMetrics
from kvroute.bridge.stream import RankStream
from kvroute.proto.events_pb2 import SubscribeRequest
from kvroute.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

SERVICE: str = "kvroute.v1.KvEvents"


def _identity(message: bytes) -> bytes:
    return message


def kv_events_handler(
    streams: Callable[[int], RankStream | None],
    *,
    token: bytes | None = None,
    metrics: BridgeMetrics | None = None,
    max_subscribers: int | None = None,
) -> grpc.GenericRpcHandler[SubscribeRequest, bytes]:
    """A handler serving `Subscribe` from the rank streams `streams(dp_rank)` returns; with a
    `token`, only to callers presenting it (others get UNAUTHENTICATED); at most
    `max_subscribers` at once over all ranks (more get RESOURCE_EXHAUSTED)."""
    rejected = RateLimitedLog(log, interval_s=10.0)
    active = [0]  # subscriptions being served, over all ranks

    async def subscribe(
        request: SubscribeRequest, context: grpc.aio.ServicerContext[SubscribeRequest, bytes]
    ) -> AsyncIterator[bytes]:
        if token is not None and not token_matches(token, context.invocation_metadata()):
            if metrics is not None:
                metrics.rejected.labels("unauthenticated").inc()
            rejected.warning(
                "unauthenticated",
                "refused a subscription without a valid token from %s",
                context.peer(),
            )
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid bridge token is needed")
            return
        if max_subscribers is not None and active[0] >= max_subscribers:
            # Each subscriber costs a snapshot and a queue: a flood must not starve the engine.
            if metrics is not None:
                metrics.rejected.labels("over_capacity").inc()
            rejected.warning(
                "over-capacity", "refused a subscription: %s subscribers already", active[0]
            )
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"at most {max_subscribers} subscribers"
            )
            return
        stream = streams(request.dp_rank)
        if stream is None:
            # Unknown yet (discovery pending) or never: the client retries with backoff.
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"this bridge does not follow dp_rank {request.dp_rank}",
            )
            return
        subscriber = stream.subscribe(request)
        active[0] += 1
        try:
            # Headers now, not with the first message: a router that resumed with nothing
            # missed gets no message until the engine's next batch, and reads the headers
            # as "accepted, up to date" to trust its kept view again at once.
            await context.send_initial_metadata(())
            while True:
                yield await subscriber.queue.get()
        finally:
            active[0] -= 1
            stream.unsubscribe(subscriber)

    method = grpc.unary_stream_rpc_method_handler(
        subscribe,
        request_deserializer=SubscribeRequest.FromString,
        response_serializer=_identity,
    )
    return grpc.method_handlers_generic_handler(SERVICE, {"Subscribe": method})


async def start_grpc_server(
    listen: str,
    handler: grpc.GenericRpcHandler[SubscribeRequest, bytes],
    tls: ServerTls | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server on `listen` ("host:port", port 0 = ephemeral), with TLS if
    `tls` is given."""
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),
            # Routers ping quiet streams to notice a cut network; with gRPC's defaults (one
            # ping per 5 min without data, 2 strikes) an idle stream was closed with
            # "too_many_pings" every minute or two.
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
            ("grpc.http2.max_ping_strikes", 0),
        ]
    )
    server.add_generic_rpc_handlers((handler,))
    if tls is None:
        port = server.add_insecure_port(listen)
    else:
        port = server.add_secure_port(listen, server_credentials(tls))
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    return server, port
