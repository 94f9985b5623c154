"""KV events on the wire, as vLLM's ZmqEventPublisher sends them (reference §1).

A PUB socket sends `[topic, seq (8 bytes BE), msgpack KVEventBatch]` per non-empty engine
step; a ROUTER socket answers replay requests `[identity, b"", start_seq]` with every buffered
batch >= start_seq and an end marker (frame layout per wire version). One thread owns both
sockets: it drains the publish queue (assigning seqs, encoding with the bridge's encoder,
keeping the replay ring) and polls the ROUTER, like vLLM's `zmq-publisher` thread.

Faults (thread-safe, set from the engine's admin endpoint): drop the next N batches from the
PUB socket (a seq gap; optionally also from the replay ring), send malformed messages, stop
answering replay requests, restart the sequence at 0 (engine restart).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq

from bridge.vllm_schema import (
    encode_batch,
    live_frames,
    parse_replay_request,
    replay_end_frames,
    replay_layout,
    replay_reply_frames,
)
from sim.events import KvEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    endpoint: str = "tcp://127.0.0.1:0"
    replay_endpoint: str | None = "tcp://127.0.0.1:0"
    topic: str = ""
    wire_version: str = "0.33"
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    dp_rank: int = 0


@dataclass(slots=True)
class _Faults:
    drop_next: int = 0
    drop_from_replay: bool = False
    malformed: list[str] | None = None  # pending malformed sends: "payload" | "frames"
    replay_enabled: bool = True
    restart: bool = False


class EventPublisher:
    """Publishes event batches; `start()` binds and runs the thread, `close()` stops it."""

    def __init__(self, config: PublisherConfig) -> None:
        self.config = config
        self.layout = replay_layout(config.wire_version)
        self._queue: queue.Queue[tuple[float, list[KvEvent]] | None] = queue.Queue(
            config.max_queue_size
        )
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._router: Any = None
        self.endpoint = self._bind(self._pub, config.endpoint)
        self.replay_endpoint: str | None = None
        if config.replay_endpoint:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
            self._router.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = self._bind(self._router, config.replay_endpoint)
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._lock = threading.Lock()
        self._faults = _Faults()
        self._thread: threading.Thread | None = None
        self.sent = 0
        self.dropped = 0
        self.queue_full = 0
        self.replays_served = 0

    @staticmethod
    def _bind(sock: Any, endpoint: str) -> str:
        sock.bind(endpoint)
        resolved: bytes = sock.getsockopt(zmq.LAST_ENDPOINT)
        return resolved.decode()

    # ---- control ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="zmq-publisher", daemon=True)
        self._thread.start()

    def publish(self, events: list[KvEvent], ts: float | None = None) -> None:
        """Queue one step's events (never blocks the engine; a full queue drops and counts)."""
        if not events:
            return
        try:
            self._queue.put_nowait((time.time() if ts is None else ts, events))
        except queue.Full:
            self.queue_full += 1
            log.warning("event queue full (%d), batch dropped", self.config.max_queue_size)

    def close(self, timeout: float = 2.0) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None
        self._pub.close(0)
        if self._router is not None:
            self._router.close(0)
        self._ctx.term()

    def drop_next(self, n: int, from_replay: bool = False) -> None:
        with self._lock:
            self._faults.drop_next += n
            self._faults.drop_from_replay = from_replay

    def send_malformed(self, kind: str = "payload") -> None:
        if kind not in ("payload", "frames"):
            raise ValueError(f"malformed kind must be 'payload' or 'frames', not {kind!r}")
        with self._lock:
            self._faults.malformed = [*(self._faults.malformed or []), kind]
        self._queue.put((0.0, []))  # wake the thread

    def set_replay_enabled(self, enabled: bool) -> None:
        with self._lock:
            self._faults.replay_enabled = enabled

    def restart(self) -> None:
        """Like a new engine process: the sequence starts again at 0, the ring is empty."""
        with self._lock:
            self._faults.restart = True
        self._queue.put((0.0, []))

    @property
    def next_seq(self) -> int:
        return self._seq

    def state(self) -> dict[str, Any]:
        with self._lock:
            f = self._faults
            return {
                "next_seq": self._seq,
                "sent": self.sent,
                "dropped": self.dropped,
                "drop_pending": f.drop_next,
                "replay_enabled": f.replay_enabled,
                "replays_served": self.replays_served,
                "ring": len(self._ring),
            }

    def kv_events_config(self) -> dict[str, Any]:
        """vLLM's KVEventsConfig with resolved endpoints (GET /kv_event_sources)."""
        c = self.config
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "buffer_steps": c.buffer_steps,
            "hwm": c.hwm,
            "max_queue_size": c.max_queue_size,
            "topic": c.topic,
        }

    # ---- the publisher thread -----------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        while True:
            if self._router is not None and dict(poller.poll(0)):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            self._apply_pending_faults()
            ts, events = item
            if events:
                self._send(ts, events)

    def _apply_pending_faults(self) -> None:
        with self._lock:
            restart, self._faults.restart = self._faults.restart, False
            malformed, self._faults.malformed = self._faults.malformed, None
        if restart:
            self._seq = 0
            self._ring.clear()
        for kind in malformed or []:
            topic = self.config.topic.encode()
            if kind == "frames":
                self._pub.send_multipart([topic, b"\x00\x01"])  # 2 frames, short seq
            else:
                seq = self._take_seq()
                self._pub.send_multipart(live_frames(topic, seq, b"\xc1not msgpack"))

    def _take_seq(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _send(self, ts: float, events: list[KvEvent]) -> None:
        payload = encode_batch(ts, events, self.config.dp_rank, self.config.wire_version)
        seq = self._take_seq()
        with self._lock:
            drop = self._faults.drop_next > 0
            if drop:
                self._faults.drop_next -= 1
            from_replay = self._faults.drop_from_replay
        if drop:
            self.dropped += 1
        else:
            self._pub.send_multipart(live_frames(self.config.topic, seq, payload))
            self.sent += 1
        if not (drop and from_replay):
            self._ring.append((seq, payload))

    def _serve_replay(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            with self._lock:
                enabled = self._faults.replay_enabled
            if not enabled:
                continue
            try:
                identity, start = parse_replay_request(frames)
            except ValueError:
                log.warning("ignoring malformed replay request (%d frames)", len(frames))
                continue
            for seq, payload in list(self._ring):
                if seq >= start:
                    self._router.send_multipart(
                        replay_reply_frames(identity, self.config.topic, seq, payload, self.layout)
                    )
            self._router.send_multipart(replay_end_frames(identity, self.layout))
            self.replays_served += 1
