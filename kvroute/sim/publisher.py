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

from kvroute.bridge.vllm_schema import (
    encode_batch,
    live_frames,
    parse_replay_request,
    replay_end_frames,
    replay_layout,
    replay_reply_frames,
)
from kvroute.sim.events import KvEvent

log = logging.getLogger(__name__)

MALFORMED_KINDS = ("payload", "frames")  # a payload that is not msgpack; 2 frames, short seq


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    """vLLM's KVEventsConfig, as far as the simulated publisher uses it."""

    endpoint: str = "tcp://127.0.0.1:0"
    replay_endpoint: str | None = "tcp://127.0.0.1:0"
    topic: str = ""
    wire_version: str = "0.33"
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    dp_rank: int = 0


@dataclass(slots=True)
class _Control:
    """A fault applied in queue order, so it affects exactly the batches published after it."""

    kind: str  # "drop" | "malformed" | "restart"
    count: int = 0
    from_replay: bool = False
    malformed: str = "payload"


_Item = tuple[float, list[KvEvent]] | _Control | None


class EventPublisher:
    """Publishes event batches; `start()` binds and runs the thread, `close()` stops it."""

    def __init__(self, config: PublisherConfig) -> None:
        self.config = config
        self.layout = replay_layout(config.wire_version)
        self._queue: queue.Queue[_Item] = queue.Queue(config.max_queue_size)
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
        self._replay_enabled = True
        self._drop_next = 0  # owned by the publisher thread
        self._drop_from_replay = False
        self._thread: threading.Thread | None = None
        self.accepted = 0  # batches queued by publish(); the thread is idle when sent + dropped
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
        """Start the publisher thread."""
        self._thread = threading.Thread(target=self._run, name="zmq-publisher", daemon=True)
        self._thread.start()

    def publish(self, events: list[KvEvent], ts: float | None = None) -> None:
        """Queue one step's events (never blocks the engine; a full queue drops and counts)."""
        if not events:
            return
        try:
            self._queue.put_nowait((time.time() if ts is None else ts, events))
            self.accepted += 1
        except queue.Full:
            self.queue_full += 1
            log.warning("event queue full (%d), batch dropped", self.config.max_queue_size)

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread (after what is queued) and close the sockets."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None
        self._pub.close(0)
        if self._router is not None:
            self._router.close(0)
        self._ctx.term()

    def drop_next(self, n: int, from_replay: bool = False) -> None:
        """Drop the next n batches published from now on from the PUB socket."""
        self._queue.put(_Control("drop", count=n, from_replay=from_replay))

    def send_malformed(self, kind: str = "payload") -> None:
        """Send one malformed message next: a bad payload (uses a seq) or bad frames."""
        if kind not in MALFORMED_KINDS:
            raise ValueError(f"malformed kind must be one of {MALFORMED_KINDS}, not {kind!r}")
        self._queue.put(_Control("malformed", malformed=kind))

    def set_replay_enabled(self, enabled: bool) -> None:
        """Answer (True) or ignore (False) replay requests."""
        with self._lock:
            self._replay_enabled = enabled

    def restart(self) -> None:
        """Like a new engine process: the sequence starts again at 0, the ring is empty."""
        self._queue.put(_Control("restart"))

    @property
    def next_seq(self) -> int:
        return self._seq

    def state(self) -> dict[str, Any]:
        """Counters and fault settings, for GET /sim/faults."""
        with self._lock:
            replay_enabled = self._replay_enabled
        return {
            "next_seq": self._seq,
            "sent": self.sent,
            "dropped": self.dropped,
            "drop_pending": self._drop_next,
            "replay_enabled": replay_enabled,
            "replays_served": self.replays_served,
            "ring": len(self._ring),
            "queued": self._queue.qsize(),
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
            if isinstance(item, _Control):
                self._control(item)
            else:
                self._send(*item)

    def _control(self, c: _Control) -> None:
        if c.kind == "drop":
            self._drop_next += c.count
            self._drop_from_replay = c.from_replay
        elif c.kind == "restart":
            self._seq = 0
            self._ring.clear()
            self._drop_next = 0
        elif c.kind == "malformed":
            topic = self.config.topic.encode()
            if c.malformed == "frames":
                self._pub.send_multipart([topic, b"\x00\x01"])  # 2 frames, short seq
            else:
                self._pub.send_multipart(live_frames(topic, self._take_seq(), b"\xc1not msgpack"))

    def _take_seq(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def _send(self, ts: float, events: list[KvEvent]) -> None:
        payload = encode_batch(ts, events, self.config.dp_rank, self.config.wire_version)
        seq = self._take_seq()
        drop = self._drop_next > 0
        if drop:
            self._drop_next -= 1
            self.dropped += 1
        else:
            self._pub.send_multipart(live_frames(self.config.topic, seq, payload))
            self.sent += 1
        if not (drop and self._drop_from_replay):
            self._ring.append((seq, payload))

    def _serve_replay(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            with self._lock:
                enabled = self._replay_enabled
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
