"""The router's own event-loop stalls are kept out of the timeouts that judge workers."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from router.http1 import Http1Pool, UpstreamTimeout
from router.loop_stall import MAX_STRETCH, LoopStalls, wait_own_time


def test_stalled_since_counts_the_overlap_of_recorded_stalls() -> None:
    stalls = LoopStalls()
    stalls.record(0.5, now=10.0)  # stalled over [9.5, 10]
    stalls.record(0.001, now=11.0)  # scheduling noise: not a stall
    stalls.record(0.2, now=12.0)  # [11.8, 12]
    assert stalls.stalled_since(0.0, now=13.0) == pytest.approx(0.7)
    assert stalls.stalled_since(9.75, now=13.0) == pytest.approx(0.45)
    assert stalls.stalled_since(11.9, now=13.0) == pytest.approx(0.1)
    assert stalls.stalled_since(12.0, now=13.0) == 0.0
    assert stalls.total_s == pytest.approx(0.7)


def test_stalls_are_bounded() -> None:
    stalls = LoopStalls(max_recorded=3)
    for i in range(10):
        stalls.record(0.1, now=float(i))
    # only the newest three are remembered; the total still counts all
    assert stalls.stalled_since(0.0, now=10.0) == pytest.approx(0.3)
    assert stalls.total_s == pytest.approx(1.0)


async def _stall_after(delay: float, seconds: float) -> None:
    await asyncio.sleep(delay)
    time.sleep(seconds)  # the whole loop blocks, as in one long pass over a burst


@pytest.mark.parametrize("measured", [True, False])
def test_a_completion_hidden_by_a_stall_is_not_a_timeout(measured: bool) -> None:
    async def main() -> None:
        stalls = LoopStalls()
        stalls.start()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        # the answer is ready 10 ms in, but the loop is blocked from 5 ms to 405 ms
        loop.call_later(0.005, time.sleep, 0.4)
        loop.call_later(0.01, done.set_result, "answer")
        try:
            if measured:
                assert await wait_own_time(done, 0.1, stalls) == "answer"
            else:
                with pytest.raises(TimeoutError):
                    await wait_own_time(done, 0.1, None)
            assert not measured or stalls.total_s >= 0.3
        finally:
            await stalls.stop()

    asyncio.run(main())


def test_a_real_timeout_still_fires_on_time() -> None:
    async def main() -> None:
        stalls = LoopStalls()
        stalls.start()
        never = asyncio.get_running_loop().create_future()
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await wait_own_time(never, 0.2, stalls)
        took = time.monotonic() - started
        assert 0.2 <= took < 1.0
        assert never.cancelled()
        await stalls.stop()

    asyncio.run(main())


def test_stalls_stretch_a_timeout_only_up_to_the_cap() -> None:
    async def main() -> None:
        stalls = LoopStalls()
        stalls.start()
        never = asyncio.get_running_loop().create_future()
        started = time.monotonic()
        stall = asyncio.create_task(_stall_after(0.01, 0.25))  # 0.25 s stall > 0.1 s timeout
        with pytest.raises(TimeoutError):
            await wait_own_time(never, 0.05, stalls)
        took = time.monotonic() - started
        await stall
        # without the cap the wait would last 0.05 + 0.25 s of own time; the cap is 4x
        assert took < 0.05 * MAX_STRETCH + 0.3
        await stalls.stop()

    asyncio.run(main())


def test_cancelling_the_caller_cancels_the_wait() -> None:
    async def main() -> None:
        stalls = LoopStalls()
        stalls.start()
        inner = asyncio.get_running_loop().create_future()
        waiting = asyncio.create_task(wait_own_time(inner, 10.0, stalls))
        await asyncio.sleep(0.02)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert inner.cancelled()
        await stalls.stop()

    asyncio.run(main())


@pytest.mark.parametrize("measured", [True, False])
def test_a_connect_during_a_router_stall_is_not_charged_to_the_worker(measured: bool) -> None:
    """The kernel completes a loopback handshake at once; the router only notices after its
    loop is free again. With stalls measured that is a connection, not a connect timeout."""

    async def main() -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        stalls = LoopStalls()
        stalls.start()
        pool = Http1Pool(
            limit=4, connect_s=0.2, read_idle_s=5.0, stalls=stalls if measured else None
        )
        try:
            connecting = asyncio.create_task(pool._acquire(("127.0.0.1", port)))
            await asyncio.sleep(0)  # the connect is under way
            time.sleep(0.6)  # the router's loop is busy for three connect timeouts
            if measured:
                conn = await connecting
                assert pool.open_connections == 1
                conn.close()
            else:
                with pytest.raises(UpstreamTimeout):
                    await connecting
                assert pool.open_connections == 0
        finally:
            await pool.close()
            await stalls.stop()
            listener.close()

    asyncio.run(main())
