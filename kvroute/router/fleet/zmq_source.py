"""KV events straight from an engine's ZMQ socket, for a single host without a bridge process.

The bridge's own pieces run inside the router: `EngineFollower` (subscription, ordering,
replay requests, restarts, conversion) feeds a `RankStream` (engine state for snapshots,
resume ring), and this transport subscribes to that stream in memory exactly as the gRPC
server would, so the router sees the same snapshot-then-batches protocol either way.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import zmq.asyncio

from kvroute.bridge.follower import EngineEndpoints, EngineFollower
from kvroute.bridge.metrics import BridgeMetrics
from kvroute.bridge.state import EngineState
from kvroute.bridge.stream import RankStream
from kvroute.proto import events_pb2


class ZmqTransport:
    """An in-process bridge for one engine rank; the follower starts on first `open`."""

    def __init__(self, events: str, replay: str | None, topic: str, dp_rank: int) -> None:
        self._endpoints = EngineEndpoints(
            dp_rank=dp_rank, events=events, replay=replay, topic=topic
        )
        # Its own registry: the bridge's series are per rank and would collide across workers.
        self._metrics = BridgeMetrics()
        self._ctx = zmq.asyncio.Context()
        state = EngineState(dp_rank)
        self._stream = RankStream(dp_rank, f"inproc-{uuid.uuid4().hex[:8]}", state, self._metrics)
        self._follower = EngineFollower(self._endpoints, self._stream, self._metrics, self._ctx)
        self._task: asyncio.Task[None] | None = None

    async def open(
        self, request: events_pb2.SubscribeRequest
    ) -> AsyncIterator[events_pb2.SubscribeResponse | None]:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._follower.run())
        subscriber = self._stream.subscribe(request)
        try:
            yield None  # in memory: established at once
            while True:
                raw = await subscriber.queue.get()
                yield events_pb2.SubscribeResponse.FromString(raw)
        finally:
            self._stream.unsubscribe(subscriber)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._ctx.term()
