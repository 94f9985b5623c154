"""Subscribe to a kvroute bridge from a router: reconnect, back off, resume.

    async for message in subscribe("127.0.0.1:50051", dp_rank=0):
        if message.HasField("snapshot"):
            view.replace(message.snapshot)     # always replaces the view (empty = reset)
        else:
            view.apply(message.batch)

The iterator never ends on its own (cancel the task to stop). Across reconnects it asks the
bridge to resume after the last sequence it delivered on the same stream; the bridge sends
the missed batches, or a snapshot if it cannot. Only grpcio and the generated proto are used.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import grpc.aio

from kvroute.bridge.auth import call_metadata
from kvroute.proto.events_pb2 import SubscribeRequest, SubscribeResponse

log = logging.getLogger(__name__)

SUBSCRIBE_METHOD = "/kvroute.v1.KvEvents/Subscribe"


@dataclass
class ResumePoint:
    """Where a subscriber is: the bridge's stream id and the last sequence applied."""

    stream_id: str = ""
    sequence: int | None = None

    def observe(self, message: SubscribeResponse) -> None:
        """Advance past a message that was delivered."""
        if message.HasField("snapshot"):
            snapshot = message.snapshot
            self.stream_id = snapshot.stream_id
            self.sequence = snapshot.sequence if snapshot.has_sequence else None
        elif message.HasField("batch"):
            self.sequence = message.batch.sequence

    def request(self, dp_rank: int) -> SubscribeRequest:
        """The request that resumes from here (or starts afresh)."""
        if self.stream_id and self.sequence is not None:
            return SubscribeRequest(
                dp_rank=dp_rank,
                resume=True,
                stream_id=self.stream_id,
                after_sequence=self.sequence,
            )
        return SubscribeRequest(dp_rank=dp_rank)


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter between reconnection attempts."""

    initial: float = 0.1
    maximum: float = 5.0
    factor: float = 2.0

    def delays(self) -> AsyncIterator[float]:
        """An endless series of jittered delays, starting again from `initial`."""
        return _delays(self)


async def _delays(backoff: Backoff) -> AsyncIterator[float]:
    delay = backoff.initial
    while True:
        yield delay * random.uniform(0.5, 1.0)
        delay = min(delay * backoff.factor, backoff.maximum)


async def subscribe(
    target: str,
    dp_rank: int = 0,
    *,
    backoff: Backoff = Backoff(),
    position: ResumePoint | None = None,
    channel_options: Sequence[tuple[str, int | str]] = (),
    credentials: grpc.ChannelCredentials | None = None,
    token: bytes | None = None,
) -> AsyncIterator[SubscribeResponse]:
    """Yield the bridge's messages for `dp_rank` forever, reconnecting as needed.

    `position` (updated in place as messages are yielded) lets a caller resume a previous
    subscription or inspect where it is. `credentials` connect over TLS; `token` is sent to a
    bridge that asks for one.
    """
    metadata = call_metadata(token)
    point = position if position is not None else ResumePoint()
    delays = backoff.delays()
    while True:
        received = False
        try:
            options = list(channel_options)
            channel = (
                grpc.aio.secure_channel(target, credentials, options=options)
                if credentials is not None
                else grpc.aio.insecure_channel(target, options=options)
            )
            async with channel:
                method = channel.unary_stream(
                    SUBSCRIBE_METHOD,
                    request_serializer=SubscribeRequest.SerializeToString,
                    response_deserializer=SubscribeResponse.FromString,
                )
                call = method(point.request(dp_rank), metadata=metadata)
                async for message in call:
                    if not received:
                        received = True
                        delays = backoff.delays()
                    point.observe(message)
                    yield message
            log.info("bridge %s ended the stream; reconnecting", target)
        except grpc.aio.AioRpcError as exc:
            log.info("bridge %s rank %s: %s; reconnecting", target, dp_rank, exc.code().name)
        await asyncio.sleep(await anext(delays))
