"""Test-side helpers: a fake vLLM engine (real ZMQ PUB + ROUTER on loopback, encoded with
kvroute.bridge.vllm_schema), a subscriber that records what a bridge sends, and a view model."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from kvroute.bridge import vllm_schema as s
from kvroute.bridge.client import ResumePoint, subscribe
from kvroute.bridge.follower import EngineEndpoints
from kvroute.proto.events_pb2 import KvGroupEvent, SubscribeResponse

STORE, REMOVE, CLEAR, INVALID = (
    KvGroupEvent.STORE,
    KvGroupEvent.REMOVE,
    KvGroupEvent.CLEAR,
    KvGroupEvent.INVALID,
)


class FakeEngine:
    """Publishes like vLLM's ZmqEventPublisher: PUB [topic, seq, payload], replay ROUTER."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        version: str = "0.33",
        topic: str = "kv",
        replay: bool = True,
        buffer_steps: int = 10_000,
        dp_rank: int = 0,
        pub_port: int = 0,
        replay_port: int = 0,
    ) -> None:
        self.ctx = ctx
        self.version = version
        self.topic = topic
        self.dp_rank = dp_rank
        self.layout = s.replay_layout(version)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub_port = _bind(self.pub, pub_port)
        self.router: zmq.asyncio.Socket | None = None
        self.replay_port = 0
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.replay_port = _bind(self.router, replay_port)
        self.replay_requests: list[int] = []
        self._task = asyncio.ensure_future(self._serve_replay()) if self.router else None

    def endpoints(self) -> EngineEndpoints:
        return EngineEndpoints(
            dp_rank=self.dp_rank,
            events=f"tcp://127.0.0.1:{self.pub_port}",
            replay=f"tcp://127.0.0.1:{self.replay_port}" if self.router else None,
            topic=self.topic,
        )

    async def publish(self, events: Sequence[s.Event], *, drop: bool = False) -> int:
        """Publish one batch (or, with drop, buffer it for replay but lose it on PUB)."""
        seq = self.seq
        self.seq += 1
        payload = s.encode_batch(time.time(), events, self.dp_rank, self.version)
        self.buffer.append((seq, payload))
        if not drop:
            await self.pub.send_multipart(s.live_frames(self.topic, seq, payload))
        return seq

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            identity, start = s.parse_replay_request(frames)
            self.replay_requests.append(start)
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self.router.send_multipart(
                        s.replay_reply_frames(identity, self.topic, seq, payload, self.layout)
                    )
            await self.router.send_multipart(s.replay_end_frames(identity, self.layout))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


def _bind(sock: zmq.asyncio.Socket, port: int) -> int:
    if port == 0:
        return sock.bind_to_random_port("tcp://127.0.0.1")
    deadline = time.monotonic() + 5
    while True:  # the previous engine's port may take a moment to be released
        try:
            sock.bind(f"tcp://127.0.0.1:{port}")
            return port
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def store(hashes: list[int], parent: int | None, tokens: list[int], **kw: Any) -> s.BlockStored:
    kw.setdefault("group_idx", 0)
    kw.setdefault("kv_cache_spec_kind", "full_attention")
    return s.BlockStored(hashes, parent, tokens, 16, **kw)


def be(value: int) -> bytes:
    return value.to_bytes(8, "big")


class View:
    """A subscriber's view: copy counts per (group, hash), replaced by snapshots."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[int, bytes]] = Counter()

    def replace(self, events: Any) -> None:
        self.counts.clear()
        self.apply(events)

    def apply(self, events: Any) -> None:
        for ev in events:
            if ev.operation == STORE:
                for bh in ev.block_hashes:
                    self.counts[(ev.group_id, bh)] += 1
            elif ev.operation == REMOVE:
                for bh in ev.block_hashes:
                    if self.counts[(ev.group_id, bh)] > 0:
                        self.counts[(ev.group_id, bh)] -= 1
                    if not self.counts[(ev.group_id, bh)]:
                        del self.counts[(ev.group_id, bh)]
            else:
                self.counts.clear()


class Recorder:
    """Subscribes through kvroute.bridge.client and records every message, keeping a View."""

    def __init__(self, target: str, dp_rank: int = 0, position: ResumePoint | None = None) -> None:
        self.messages: list[SubscribeResponse] = []
        self.view = View()
        self.position = position if position is not None else ResumePoint()
        self._changed = asyncio.Event()
        self._task = asyncio.ensure_future(self._run(target, dp_rank))

    async def _run(self, target: str, dp_rank: int) -> None:
        async for message in subscribe(target, dp_rank, position=self.position):
            if message.HasField("snapshot"):
                self.view.replace(message.snapshot.events)
            else:
                self.view.apply(message.batch.events)
            self.messages.append(message)
            self._changed.set()

    def snapshots(self) -> list[Any]:
        return [m.snapshot for m in self.messages if m.HasField("snapshot")]

    def batches(self) -> list[Any]:
        return [m.batch for m in self.messages if m.HasField("batch")]

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out; got {len(self.messages)} messages")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 0.2))

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def eventually(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)
