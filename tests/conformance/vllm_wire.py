"""The wire side of the recording: vLLM's real ZmqEventPublisher and the sockets that listen.

Runs only in the vLLM environment (imported by vllm_driver.py).
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import zmq
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WireCapture:
    """vLLM's ZmqEventPublisher plus a SUB socket recording every message it sends.

    transport "tcp": the SUB binds 127.0.0.1 on an ephemeral port and vLLM connects to it
    (vLLM's connect mode); the replay ROUTER binds a free loopback port.
    transport "inproc": vLLM binds inproc endpoints (offset by DP rank) and the SUB connects.
    """

    def __init__(self, name: str, transport: str, topic: str, dp_rank: int) -> None:
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.topic = topic
        if transport == "tcp":
            port = self.sub.bind_to_random_port("tcp://127.0.0.1")
            endpoint = f"tcp://127.0.0.1:{port}"
            replay = f"tcp://127.0.0.1:{_free_tcp_port()}"
            if dp_rank:
                raise ValueError("tcp connect mode offsets the port by rank; use inproc")
        elif transport == "inproc":
            endpoint, replay = f"inproc://kv-{name}", f"inproc://kv-{name}-replay"
        else:
            raise ValueError(transport)
        self.publisher = ZmqEventPublisher(
            data_parallel_rank=dp_rank, endpoint=endpoint, replay_endpoint=replay, topic=topic
        )
        resolved = self.publisher.get_publisher_config()
        if transport == "inproc":
            self.sub.connect(resolved.endpoint)
        self.replay_endpoint = resolved.replay_endpoint
        # Let the subscription reach the publisher before the first batch. A SUB attaches a
        # new connection (and sends its subscription on it) only while it processes its own
        # commands, i.e. while it is polled; a bound SUB that is merely waited on never
        # subscribes, and vLLM's PUB then drops everything it sends.
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            self.sub.poll(10)
        self.frames: list[list[bytes]] = []
        self.published = 0

    def publish(self, batch: KVEventBatch) -> None:
        self.publisher.publish(batch)
        self.published += 1
        self.drain(0)

    def drain(self, timeout_ms: int) -> None:
        while self.sub.poll(timeout_ms):
            self.frames.append(self.sub.recv_multipart())
            timeout_ms = 0

    def wait_all(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.frames) < self.published and time.monotonic() < deadline:
            self.drain(50)
        seqs = [int.from_bytes(f[1], "big") for f in self.frames]
        if seqs != list(range(self.published)):
            raise RuntimeError(
                f"captured seqs {seqs[:5]}... ({len(seqs)}) != 0..{self.published - 1}"
            )

    def replay(self, start_seq: int, timeout: float = 10.0) -> list[list[bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
            replies: list[list[bytes]] = []
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if not dealer.poll(100):
                    continue
                message = dealer.recv_multipart()
                replies.append(message)
                if len(message) >= 2 and message[-2] == END_SEQ:
                    return replies
            raise RuntimeError("replay did not finish")
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.publisher.shutdown()
        self.sub.close(linger=0)


class ServedPublisher:
    """vLLM's ZmqEventPublisher bound on ipc endpoints for a bridge in another process.

    Protocol on stdin/stdout (one line each): after `pause_at` batches it prints
    `PAUSED <name> <count> <endpoint> <replay endpoint>` and waits for `GO`; at the end of
    the scenario it prints `DONE <name> <count>` and waits for `NEXT` before shutting down.
    """

    def __init__(self, name: str, directory: Path, topic: str, pause_at: int) -> None:
        self.name = name
        self.endpoint = f"ipc://{directory}/{name}.pub"
        self.replay_endpoint = f"ipc://{directory}/{name}.replay"
        self.publisher = ZmqEventPublisher(
            data_parallel_rank=0,
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
            topic=topic,
        )
        self.pause_at = pause_at
        self.published = 0

    def publish(self, batch: KVEventBatch) -> None:
        self.publisher.publish(batch)
        self.published += 1
        if self.published == self.pause_at:
            self._handshake(
                f"PAUSED {self.name} {self.published} {self.endpoint} {self.replay_endpoint}",
                "GO",
            )

    def finish(self) -> None:
        self._handshake(f"DONE {self.name} {self.published}", "NEXT")
        self.publisher.shutdown()

    @staticmethod
    def _handshake(announce: str, expect: str) -> None:
        print(announce, flush=True)
        answer = sys.stdin.readline().strip()
        if answer != expect:
            raise SystemExit(f"expected {expect!r} on stdin, got {answer!r}")
