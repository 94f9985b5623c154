"""KV-event subscriptions: one per worker, feeding the index on the event loop.

Each worker with a `bridge` address is followed over gRPC (snapshot first, then live batches);
a lost stream is retried with exponential backoff and resumed after the last applied sequence
(the bridge answers with the missing batches, or a snapshot when it cannot). While a stream is
down the worker's view is not trusted: `usable()` is False and the router treats the worker as
having no evidence, without throwing the view away, so a quick resume keeps it warm.

A resync (asked by verification when predictions keep missing) discards the view and
subscribes afresh, which makes the bridge send a snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from google.protobuf.message import DecodeError

from kvroute.bridge.auth import call_metadata, channel_credentials, read_token
from kvroute.bridge.client import SUBSCRIBE_METHOD, ResumePoint
from kvroute.proto import events_pb2
from kvroute.ratelog import RateLimitedLog
from kvroute.router.config import EventsConfig
from kvroute.router.fleet.workers import Worker
from kvroute.router.ops.metrics import RouterMetrics
from kvroute.router.routing.index_view import IndexView

log = logging.getLogger("kvroute.router.events")

CONNECTING = "connecting"
LIVE = "live"
LOST = "lost"


@dataclass(slots=True)
class StreamStatus:
    state: str = CONNECTING
    since: float = field(default_factory=time.monotonic)
    last_message_at: float | None = None
    last_sequence: int | None = None
    stream_id: str = ""
    snapshots: int = 0
    batches: int = 0
    reconnects: int = 0
    last_error: str = ""


class Transport(Protocol):
    """Opens one subscription; yields None once the stream is established (the bridge has
    accepted it), then the bridge's responses until the stream ends."""

    def open(
        self, request: events_pb2.SubscribeRequest
    ) -> AsyncIterator[events_pb2.SubscribeResponse | None]: ...

    async def close(self) -> None: ...


class GrpcTransport:
    """The bridge's KvEvents.Subscribe over one gRPC channel (kept across reconnects); over
    TLS with `credentials`, sending `token` to bridges that ask for one."""

    def __init__(
        self,
        target: str,
        keepalive_s: float = 20.0,
        timeout_s: float = 10.0,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        token: bytes | None = None,
        server_name: str | None = None,
    ) -> None:
        options: list[tuple[str, int | str]] = [
            ("grpc.max_receive_message_length", 512 * 1024 * 1024),
            ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
            # grpc 1.8x waits for a ping's ack this long (default 60 s), whatever the
            # keepalive timeout says: without it a silent cut went unnoticed for a minute
            ("grpc.http2.ping_timeout_ms", int(timeout_s * 1000)),
            # keep pinging on a quiet stream (an idle engine sends nothing for minutes)
            ("grpc.http2.max_pings_without_data", 0),
        ]
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        self._channel = (
            grpc.aio.secure_channel(target, credentials, options=options)
            if credentials is not None
            else grpc.aio.insecure_channel(target, options=options)
        )
        self._metadata = call_metadata(token)
        self._subscribe = self._channel.unary_stream(
            SUBSCRIBE_METHOD,
            request_serializer=events_pb2.SubscribeRequest.SerializeToString,
            # decoded in open(): grpc's own decoding logs every bad message and yields None
            response_deserializer=_raw,
        )

    async def open(
        self, request: events_pb2.SubscribeRequest
    ) -> AsyncIterator[events_pb2.SubscribeResponse | None]:
        call = self._subscribe(request, metadata=self._metadata)
        try:
            await call.initial_metadata()  # headers: the bridge accepted the subscription...
            if not call.done():  # ...unless the call already failed (a refused connection)
                yield None
            async for raw in call:
                try:
                    message = events_pb2.SubscribeResponse.FromString(raw)
                except DecodeError as exc:
                    raise BadMessage(f"undecodable message from the bridge: {exc}") from None
                yield message
        finally:
            call.cancel()

    async def close(self) -> None:
        await self._channel.close(grace=None)


class BadMessage(Exception):
    """The bridge sent bytes that are not a SubscribeResponse: the stream is dropped and
    subscribed again (resuming after the last message applied)."""


def _raw(data: bytes) -> bytes:
    return data


# Answers that mean the bridge turned this router away (wrong token or certificate, or full).
_REFUSED = frozenset(
    {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)

TransportFactory = Callable[[Worker], "Transport | None"]


class EventFeed(Protocol):
    """What the router reads of the workers' event streams, wherever they are followed (in
    this process, `EventSubscriptions`, or in index shard processes)."""

    def worker_added(self, worker: Worker) -> None: ...
    def worker_removed(self, worker: Worker) -> None: ...
    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def status(self, name: str) -> StreamStatus | None: ...
    def unusable(self) -> set[str]: ...
    def resync(self, name: str) -> bool: ...


def default_transport(worker: Worker, cfg: EventsConfig | None = None) -> Transport | None:
    if worker.spec.bridge:
        cfg = cfg or EventsConfig()
        credentials = (
            channel_credentials(cfg.bridge_ca_file, cfg.bridge_cert_file, cfg.bridge_key_file)
            if cfg.bridge_ca_file
            else None
        )
        return GrpcTransport(
            worker.spec.bridge,
            cfg.keepalive_s,
            cfg.keepalive_timeout_s,
            credentials=credentials,
            # read per worker: a rotated Secret reaches workers added after the rotation
            token=read_token(cfg.bridge_token_file) if cfg.bridge_token_file else None,
            server_name=cfg.bridge_tls_server_name,
        )
    if worker.spec.zmq:
        from kvroute.router.fleet.zmq_source import ZmqTransport

        return ZmqTransport(
            worker.spec.zmq, worker.spec.replay, worker.spec.topic, worker.spec.dp_rank
        )
    return None


class EventSubscriptions:
    """Starts and stops one subscription task per worker (a registry listener)."""

    def __init__(
        self,
        index: IndexView,
        cfg: EventsConfig,
        metrics: RouterMetrics,
        transport_factory: TransportFactory = default_transport,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._index = index
        self._cfg = cfg
        self._metrics = metrics
        self._factory = transport_factory
        self._clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._sessions: dict[str, asyncio.Task[bool]] = {}
        self._status: dict[str, StreamStatus] = {}
        self._points: dict[str, ResumePoint] = {}
        self._unusable: set[str] = set()
        self._restarting: set[str] = set()
        self._started = False
        self._pending: list[Worker] = []
        self._ratelog = RateLimitedLog(log, interval_s=10.0)

    # -- registry listener --------------------------------------------------------------
    def worker_added(self, worker: Worker) -> None:
        if not (worker.spec.bridge or worker.spec.zmq):
            return
        self._unusable.add(worker.name)  # no evidence until its stream is live
        if not self._started:
            self._pending.append(worker)
            return
        self._start(worker)

    def worker_removed(self, worker: Worker) -> None:
        task = self._tasks.pop(worker.name, None)
        if task is not None:
            task.cancel()
        self._pending = [w for w in self._pending if w is not worker]
        self._sessions.pop(worker.name, None)
        self._status.pop(worker.name, None)
        self._points.pop(worker.name, None)
        self._unusable.discard(worker.name)
        self._restarting.discard(worker.name)
        self._index.remove_worker(worker.name)

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        self._started = True
        for worker in self._pending:
            self._start(worker)
        self._pending.clear()

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- queries --------------------------------------------------------------------------
    def status(self, name: str) -> StreamStatus | None:
        return self._status.get(name)

    def unusable(self) -> set[str]:
        """Workers whose stream is not live: their predictions must not be trusted."""
        return self._unusable

    def resync(self, name: str) -> bool:
        """Discard the worker's view and resubscribe from a snapshot; False if not followed."""
        if name not in self._tasks:
            return False
        self._index.invalidate(name)
        self._unusable.add(name)
        self._points[name] = ResumePoint()  # fresh: the bridge answers with a snapshot
        session = self._sessions.get(name)
        if session is not None and not session.done():
            self._restarting.add(name)
            session.cancel()
        return True

    # -- the loop -------------------------------------------------------------------------
    def _start(self, worker: Worker) -> None:
        self._status[worker.name] = StreamStatus()
        self._points[worker.name] = ResumePoint()
        self._unusable.add(worker.name)
        self._tasks[worker.name] = asyncio.create_task(
            self._follow(worker), name=f"kvroute-events-{worker.name}"
        )

    async def _follow(self, worker: Worker) -> None:
        name = worker.name
        status = self._status[name]
        try:
            transport = self._factory(worker)
        except ValueError as exc:  # an unreadable token or certificate file
            self._ratelog.error(name, "events %s: cannot subscribe: %s", name, exc)
            status.last_error = str(exc)
            return
        if transport is None:
            return
        delay = self._cfg.reconnect_initial_s
        me = asyncio.current_task()
        try:
            while True:
                session = asyncio.create_task(self._session(worker, transport, status))
                self._sessions[name] = session
                try:
                    got_message = await session
                except asyncio.CancelledError:
                    if name in self._restarting and me is not None and not me.cancelling():
                        self._restarting.discard(name)
                        status.state = CONNECTING
                        continue  # a resync: subscribe again at once, from a snapshot
                    session.cancel()
                    raise
                except Exception as exc:  # a transport bug: keep following, with backoff
                    self._ratelog.error(name, "events %s: subscription failed: %r", name, exc)
                    status.last_error = repr(exc)
                    got_message = False
                self._mark_lost(name, status)
                if got_message:
                    delay = self._cfg.reconnect_initial_s
                status.reconnects += 1
                await asyncio.sleep(delay * (0.8 + 0.4 * random.random()))
                delay = min(delay * 2, self._cfg.reconnect_max_s)
        finally:
            await transport.close()

    async def _session(self, worker: Worker, transport: Transport, status: StreamStatus) -> bool:
        """One subscription until it ends; True if anything arrived."""
        name = worker.name
        point = self._points[name]
        request = point.request(worker.spec.dp_rank)
        resumed = request.resume
        status.state = CONNECTING
        got = False
        stream = transport.open(request)
        delay = self._cfg.apply_delay_s
        applied_at = -1e9  # loop time when the last batch was applied
        loop = asyncio.get_running_loop()
        try:
            async for message in stream:
                got = True
                if message is None:
                    if resumed:  # the view we kept is current again
                        self._go_live(name, status)
                    continue
                # An engine publishes a step's events as it sends that step's tokens, so a
                # batch reaches the router with first tokens of streams it relays; those go
                # out first. Only a live batch waits: one that follows the last apply within
                # the delay is part of a backlog and is applied at once.
                if delay > 0 and loop.time() - applied_at >= delay and message.HasField("batch"):
                    await asyncio.sleep(delay)
                try:
                    await self._handle(name, status, message)
                except Exception as exc:  # a bad message must not kill the subscription
                    self._ratelog.error(
                        name, "events %s: cannot apply a message (%s); resynchronising", name, exc
                    )
                    self._metrics.child(self._metrics.resyncs, name, "apply_error").inc()
                    self._index.invalidate(name)
                    self._points[name] = ResumePoint()
                    status.last_error = f"apply failed: {exc}"
                    return got
                point.observe(message)
                applied_at = loop.time()
            status.last_error = "stream ended"
        except grpc.aio.AioRpcError as exc:
            status.last_error = f"{exc.code().name}: {exc.details()}"
            if exc.code() in _REFUSED:  # a configuration problem: say so, it will not pass
                self._ratelog.warning(
                    f"refused-{name}", "events %s: bridge refused: %s", name, status.last_error
                )
        except (OSError, ConnectionError) as exc:
            status.last_error = str(exc)
        except BadMessage as exc:
            got = False  # back off: a bridge that sends garbage will likely do it again
            status.last_error = str(exc)
            self._metrics.event_bad_messages.labels(name).inc()
            self._ratelog.warning(f"bad-{name}", "events %s: %s; resubscribing", name, exc)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        return got

    async def _handle(
        self, name: str, status: StreamStatus, message: events_pb2.SubscribeResponse
    ) -> None:
        started = time.perf_counter()
        kind = message.WhichOneof("message")
        if kind == "snapshot":
            snap = message.snapshot
            started += await self._apply_snapshot(name, snap)
            status.snapshots += 1
            status.stream_id = snap.stream_id
            status.last_sequence = snap.sequence if snap.has_sequence else None
            self._metrics.event_snapshots.labels(name, snap.reason or "unknown").inc()
            if status.state != LIVE:
                log.info("events %s: snapshot (%s), %d events", name, snap.reason, len(snap.events))
            self._go_live(name, status)
        elif kind == "batch":
            batch = message.batch
            self._index.apply(name, batch)
            if batch.timestamp > 0:  # the engine's wall clock (vLLM: time.time())
                self._metrics.event_lag_seconds.observe(max(0.0, time.time() - batch.timestamp))
            status.batches += 1
            status.last_sequence = batch.sequence
            self._metrics.event_batches.labels(name).inc()
        else:
            return
        self._metrics.event_apply_seconds.observe(time.perf_counter() - started)
        status.last_message_at = self._clock()

    async def _apply_snapshot(self, name: str, snap: events_pb2.Snapshot) -> float:
        """Apply a snapshot in bounded steps, letting requests run in between (the worker's
        old view answers until the new one is complete); returns the seconds spent waiting
        between steps, so only the time on the loop is measured."""
        steps = self._index.apply_snapshot_steps(name, snap, self._cfg.snapshot_step_blocks)
        waited = 0.0
        try:
            for _ in steps:
                paused = time.perf_counter()
                await asyncio.sleep(0)
                waited += time.perf_counter() - paused
        finally:
            close = getattr(steps, "close", None)
            if close is not None:
                close()  # cancelled midway: the index drops the snapshot
        return waited

    def _go_live(self, name: str, status: StreamStatus) -> None:
        if status.state == LIVE:
            return
        status.state = LIVE
        status.since = self._clock()
        status.last_error = ""
        self._unusable.discard(name)

    def _mark_lost(self, name: str, status: StreamStatus) -> None:
        if status.state == LIVE:
            log.warning(
                "events %s: stream lost (%s); view unused until back",
                name,
                status.last_error or "ended",
            )
            self._metrics.event_stream_lost.labels(name).inc()
        status.state = LOST
        status.since = self._clock()
        self._unusable.add(name)
