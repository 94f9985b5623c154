"""ZMQ clients for the sim tests: a SUB on the engine's PUB socket and a DEALER for replay."""

from __future__ import annotations

import time
from typing import Any

import zmq

from kvroute.bridge.vllm_schema import (
    BatchDecoder,
    DecodedBatch,
    LiveMessage,
    parse_live,
    parse_replay_reply,
    replay_request_frames,
)


class Subscriber:
    """A SUB socket on an engine's PUB endpoint (a context manager: closed on exit)."""

    def __init__(self, endpoint: str, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.decoder = BatchDecoder()
        time.sleep(0.3)  # let the subscription reach the publisher

    def raw(self, timeout: float = 2.0) -> list[bytes] | None:
        if self.sock.poll(int(timeout * 1000)):
            frames: list[bytes] = self.sock.recv_multipart()
            return frames
        return None

    def messages(self, quiet: float = 0.4, limit: float = 10.0) -> list[LiveMessage]:
        """Every live message until none arrives for `quiet` seconds."""
        out = []
        end = time.monotonic() + limit
        while time.monotonic() < end:
            frames = self.raw(quiet)
            if frames is None:
                break
            out.append(parse_live(frames))
        return out

    def decode(self, msg: LiveMessage) -> DecodedBatch:
        return self.decoder.decode(msg.payload)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def replay(endpoint: str, start: int, timeout: float = 2.0) -> list[Any] | None:
    """(seq, payload, topic) of every replayed batch >= start; None if no answer at all."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(replay_request_frames(start))
        out = []
        while True:
            if not sock.poll(int(timeout * 1000)):
                return out if out else None
            msg = parse_replay_reply(sock.recv_multipart())
            if msg is None:
                return out
            out.append((msg.seq, msg.payload, msg.topic))
    finally:
        sock.close(0)
        ctx.term()
