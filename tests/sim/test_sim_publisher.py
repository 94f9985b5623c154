"""The publisher's bounds: the replay ring keeps the last N batches, a full queue drops."""

from __future__ import annotations

import time

from sim_wire import replay

from kvroute.sim.events import AllBlocksCleared
from kvroute.sim.publisher import EventPublisher, PublisherConfig


def test_replay_ring_keeps_only_the_last_buffer_steps_batches() -> None:
    pub = EventPublisher(PublisherConfig(buffer_steps=3))
    pub.start()
    try:
        for _ in range(5):
            pub.publish([AllBlocksCleared()])
        deadline = time.monotonic() + 5
        while pub.next_seq < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub.replay_endpoint
        got = replay(pub.replay_endpoint, 0)
        # Asked from 0, replay silently starts at the oldest kept batch (vLLM's behaviour).
        assert got is not None and [s for s, _, _ in got] == [2, 3, 4]
        assert pub.state()["ring"] == 3
    finally:
        pub.close()


def test_full_queue_drops_and_counts_without_blocking() -> None:
    pub = EventPublisher(PublisherConfig(max_queue_size=2))  # thread not started: nothing drains
    try:
        t0 = time.monotonic()
        for _ in range(5):
            pub.publish([AllBlocksCleared()])
        assert time.monotonic() - t0 < 1.0
        assert pub.queue_full == 3
        pub.publish([])  # empty steps publish nothing
        assert pub.queue_full == 3
    finally:
        pub.close()


def test_no_replay_socket_when_disabled() -> None:
    pub = EventPublisher(PublisherConfig(replay_endpoint=None))
    try:
        assert pub.replay_endpoint is None
        assert pub.kv_events_config()["replay_endpoint"] is None
    finally:
        pub.close()
