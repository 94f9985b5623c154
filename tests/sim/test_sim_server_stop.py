"""Stopping a simulated engine while requests are still in flight: the thread-hosted engine
must stop in bounded time and leave nothing behind on its loop (a coroutine left pending on a
closed loop surfaces later, in whatever test is running, as an unraisable error)."""

from __future__ import annotations

import gc
import threading
import time

import httpx

from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.server import SimEngineThread


def test_stop_with_requests_in_flight_is_bounded_and_leaves_no_pending_task() -> None:
    # ~0.05x speed: a 400-token answer takes far longer than the test
    sim = SimEngineThread(EngineConfig(speed=0.05, num_blocks=512, max_model_len=1024))
    sim.start()
    outcomes: list[str] = []

    def send(stream: bool) -> None:
        body = {"prompt": [7] * 40, "max_tokens": 400, "ignore_eos": True, "stream": stream}
        try:
            with httpx.Client(base_url=sim.url, timeout=30) as c:
                if stream:
                    with c.stream("POST", "/v1/completions", json=body) as r:
                        for _ in r.iter_lines():
                            pass
                else:
                    c.post("/v1/completions", json=body)
            outcomes.append("answered")
        except httpx.HTTPError as exc:
            outcomes.append(type(exc).__name__)

    senders = [threading.Thread(target=send, args=(s,)) for s in (False, True, True)]
    for t in senders:
        t.start()
    deadline = time.monotonic() + 10
    while sim.engine.scheduler.num_running + sim.engine.scheduler.num_waiting < 3:
        assert time.monotonic() < deadline, "the requests never reached the engine"
        time.sleep(0.01)
    loop = sim._loop
    t0 = time.monotonic()
    sim.stop()
    took = time.monotonic() - t0
    for t in senders:
        t.join(10)
    gc.collect()  # a task dropped on a closed loop would raise here (as unraisable)
    assert took < 8, f"stop took {took:.1f} s"
    assert loop.is_closed()
    assert len(outcomes) == 3  # every client got an end (an error), none hangs
    assert sim.running is None
