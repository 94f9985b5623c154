"""The bridge process: rank streams, engine followers, gRPC server, HTTP endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq.asyncio

from kvroute.bridge.auth import ServerTls
from kvroute.bridge.discovery import discover
from kvroute.bridge.follower import DEFAULT_REPLAY_TIMEOUT, EngineEndpoints, EngineFollower
from kvroute.bridge.http import start_http
from kvroute.bridge.metrics import BridgeMetrics
from kvroute.bridge.server import kv_events_handler, start_grpc_server
from kvroute.bridge.state import DEFAULT_MAX_BLOCKS, DEFAULT_MAX_LINEAGE_BLOCKS, EngineState
from kvroute.bridge.stream import (
    DEFAULT_MAX_SNAPSHOT_BUILDS,
    RankStream,
    SnapshotBuilds,
    StreamLimits,
)
from kvroute.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

# Routers subscribe once per worker they follow: a few per router replica.
DEFAULT_MAX_SUBSCRIBERS = 64
_RESTART_INITIAL_S = 0.1
_RESTART_MAX_S = 5.0


@dataclass(frozen=True)
class BridgeConfig:
    """Everything a bridge needs; either `engines` or `discover_url`."""

    engines: tuple[EngineEndpoints, ...] = ()
    discover_url: str | None = None
    listen: str = "127.0.0.1:50051"
    http: str | None = None
    max_blocks: int = DEFAULT_MAX_BLOCKS
    max_lineage_blocks: int = DEFAULT_MAX_LINEAGE_BLOCKS
    limits: StreamLimits = field(default_factory=StreamLimits)
    replay_timeout: float = DEFAULT_REPLAY_TIMEOUT
    discover_interval: float = 30.0
    # The subscription token (None = anyone who reaches the port may subscribe); kept out of
    # the repr so that a logged config never shows it.
    token: bytes | None = field(default=None, repr=False)
    tls: ServerTls | None = None
    max_subscribers: int = DEFAULT_MAX_SUBSCRIBERS
    # Snapshot builds running at once over all ranks; more subscribers share them or wait.
    max_snapshot_builds: int = DEFAULT_MAX_SNAPSHOT_BUILDS
    # A follower failing again and again for this long fails liveness (the process restarts).
    follower_recovery_s: float = 30.0


def _is_loopback(listen: str) -> bool:
    host = listen.rpartition(":")[0].strip("[]")
    return host in ("127.0.0.1", "::1", "localhost")


class Bridge:
    """Start with `await start()`, stop with `await stop()`; one per process or test."""

    def __init__(self, config: BridgeConfig, metrics: BridgeMetrics | None = None) -> None:
        if not config.engines and not config.discover_url:
            raise ValueError("a bridge needs engine endpoints or a discovery URL")
        self.config = config
        self.metrics = metrics or BridgeMetrics()
        self.bridge_id = uuid.uuid4().hex[:12]
        self.streams: dict[int, RankStream] = {}
        self.followers: dict[int, EngineFollower] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._ctx = zmq.asyncio.Context()
        self._grpc: Any = None
        self._http: Any = None
        self._discovery: asyncio.Task[None] | None = None
        self.grpc_port = 0
        self.http_port = 0
        self._failing_since: dict[int, float] = {}  # rank -> first failure of a streak
        self._restarted_at: dict[int, float] = {}
        self._ratelog = RateLimitedLog(log, interval_s=10.0)
        self.snapshot_builds = SnapshotBuilds(config.max_snapshot_builds, self.metrics)

    async def start(self) -> None:
        """Follow the configured engines (or start discovery) and serve gRPC and HTTP."""
        for endpoints in self.config.engines:
            self._follow(endpoints)
        handler = kv_events_handler(
            self.streams.get,
            token=self.config.token,
            metrics=self.metrics,
            max_subscribers=self.config.max_subscribers,
        )
        self._grpc, self.grpc_port = await start_grpc_server(
            self.config.listen, handler, self.config.tls
        )
        if self.config.token is None and not _is_loopback(self.config.listen):
            log.warning(
                "bridge %s serves %s without a token: anyone who reaches it reads every "
                "tenant's cached tokens (see --token-file)",
                self.bridge_id,
                self.config.listen,
            )
        if self.config.http:
            self._http, self.http_port = await start_http(self.config.http, self)
        if self.config.discover_url:
            self._discovery = asyncio.ensure_future(self._discover_forever())
        log.info("bridge %s: gRPC on port %s", self.bridge_id, self.grpc_port)

    def _follow(self, endpoints: EngineEndpoints) -> None:
        rank = endpoints.dp_rank
        if rank in self.streams:
            return
        state = EngineState(
            rank,
            max_blocks=self.config.max_blocks,
            max_lineage_blocks=self.config.max_lineage_blocks,
        )
        stream = RankStream(
            rank, self.bridge_id, state, self.metrics, self.config.limits, self.snapshot_builds
        )
        follower = EngineFollower(
            endpoints, stream, self.metrics, self._ctx, replay_timeout=self.config.replay_timeout
        )
        self.streams[rank] = stream
        self.followers[rank] = follower
        self._tasks[rank] = asyncio.ensure_future(self._supervise(rank, follower))
        log.info("following rank %s at %s (replay %s)", rank, endpoints.events, endpoints.replay)

    async def _supervise(self, rank: int, follower: EngineFollower) -> None:
        """Run the follower; restart it with backoff whenever it fails."""
        loop = asyncio.get_running_loop()
        delay = _RESTART_INITIAL_S
        while True:
            started = loop.time()
            try:
                await follower.run()
                return
            except Exception as exc:  # CancelledError is not an Exception: stop passes through
                if loop.time() - started >= self.config.follower_recovery_s:
                    self._failing_since.pop(rank, None)  # it had recovered: a new streak
                    delay = _RESTART_INITIAL_S
                self._failing_since.setdefault(rank, loop.time())
                self.metrics.follower_restarts.labels(str(rank)).inc()
                self._ratelog.error(
                    f"follower-{rank}", "rank %s: follower failed (%r); restarting", rank, exc
                )
                follower.forget("follower_restart")
            await asyncio.sleep(delay)
            self._restarted_at[rank] = loop.time()
            delay = min(delay * 2, _RESTART_MAX_S)

    @property
    def alive(self) -> bool:
        """False once a rank's follower has kept failing for `follower_recovery_s`."""
        now = asyncio.get_running_loop().time()
        bound = self.config.follower_recovery_s
        for rank, since in list(self._failing_since.items()):
            if now - self._restarted_at.get(rank, since) >= bound:
                del self._failing_since[rank]  # up for the whole bound since its restart
            elif now - since >= bound:
                return False
        return True

    async def _discover_forever(self) -> None:
        assert self.config.discover_url is not None
        delay = 0.5
        while True:
            try:
                for endpoints in await discover(self.config.discover_url):
                    self._follow(endpoints)
            except Exception as exc:  # engine not up yet, or a bad answer: keep waiting
                log.info("discovery at %s failed: %s", self.config.discover_url, exc)
            delay = self.config.discover_interval if self.streams else min(delay * 2, 5.0)
            await asyncio.sleep(delay)

    @property
    def ready(self) -> bool:
        """True once every followed rank's engine socket is connected."""
        return bool(self.followers) and all(f.connected for f in self.followers.values())

    def health(self) -> dict[str, Any]:
        """What /health reports: alive, ready, and per rank its stream's position."""
        ranks = {}
        for rank, stream in sorted(self.streams.items()):
            ranks[str(rank)] = {
                "connected": self.followers[rank].connected,
                "stream_id": stream.stream_id,
                "last_sequence": stream.last_sequence,
                "blocks": stream.state.blocks,
                "subscribers": stream.subscriber_count,
                "engine": self.followers[rank].endpoints.events,
            }
        status = "ok" if self.alive else "failing"
        return {
            "status": status,
            "alive": self.alive,
            "ready": self.ready,
            "bridge_id": self.bridge_id,
            "ranks": ranks,
        }

    async def stop(self) -> None:
        """Stop following, close the servers and sockets."""
        if self._discovery is not None:
            self._discovery.cancel()
        for task in self._tasks.values():
            task.cancel()
        for task in [*self._tasks.values(), *([self._discovery] if self._discovery else [])]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._grpc is not None:
            await self._grpc.stop(grace=0.5)
        if self._http is not None:
            await self._http.cleanup()
        self._ctx.destroy(linger=0)
