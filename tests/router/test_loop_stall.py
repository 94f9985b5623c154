"""The router's own event-loop stalls are kept out of the timeouts that judge workers."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvroute.router.config import LimitsConfig, TimeoutsConfig
from kvroute.router.edge.http1 import Http1Pool, UpstreamTimeout
from kvroute.router.edge.upstream import Upstream
from kvroute.router.fleet.loop_stall import MAX_STRETCH, LoopStalls, wait_own_time
from tests.router.fake_engine import serve


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


@pytest.mark.parametrize("measured", [True, False])
def test_a_completion_hidden_by_a_stall_is_not_a_timeout(measured: bool) -> None:
    async def main() -> None:
        async with LoopStalls() as stalls:
            loop = asyncio.get_running_loop()
            done = loop.create_future()
            # the answer is ready 10 ms in, but the loop is blocked from 5 ms to 405 ms
            loop.call_later(0.005, time.sleep, 0.4)
            loop.call_later(0.01, done.set_result, "answer")
            if measured:
                assert await wait_own_time(done, 0.1, stalls) == "answer"
                assert stalls.total_s >= 0.3
            else:
                with pytest.raises(TimeoutError):
                    await wait_own_time(done, 0.1, None)

    asyncio.run(main())


def test_a_real_timeout_still_fires_on_time() -> None:
    async def main() -> None:
        async with LoopStalls() as stalls:
            never = asyncio.get_running_loop().create_future()
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await wait_own_time(never, 0.2, stalls)
            assert 0.2 <= time.monotonic() - started < 1.0
            assert never.cancelled()

    asyncio.run(main())


def test_the_ticker_runs_only_while_a_wait_is_pending() -> None:
    async def main() -> None:
        async with LoopStalls() as stalls:
            assert not stalls.ticking
            answer = asyncio.get_running_loop().create_future()
            waiting = asyncio.create_task(wait_own_time(answer, 1.0, stalls))
            await asyncio.sleep(0.06)
            assert stalls.ticking
            answer.set_result(1)
            assert await waiting == 1
            assert not stalls.ticking

    asyncio.run(main())


class _AlwaysStalled(LoopStalls):
    """A loop that, by its measurements, never runs: only the cap can end a wait."""

    def stalled_since(self, since: float, now: float) -> float:
        return now - since


def test_stalls_stretch_a_timeout_only_up_to_the_cap() -> None:
    async def main() -> None:
        never = asyncio.get_running_loop().create_future()
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await wait_own_time(never, 0.05, _AlwaysStalled())
        # uncapped this wait would never end
        assert 0.05 * MAX_STRETCH <= time.monotonic() - started < 1.0
        assert never.cancelled()

    asyncio.run(main())


def test_cancelling_the_caller_cancels_the_wait() -> None:
    async def main() -> None:
        async with LoopStalls() as stalls:
            inner = asyncio.get_running_loop().create_future()
            waiting = asyncio.create_task(wait_own_time(inner, 10.0, stalls))
            await asyncio.sleep(0.02)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert inner.cancelled()

    asyncio.run(main())


@pytest.mark.parametrize("measured", [True, False])
def test_a_connect_during_a_router_stall_is_not_charged_to_the_worker(measured: bool) -> None:
    """The kernel completes a loopback handshake at once; the router only notices after its
    loop is free again. With stalls measured that is a connection, not a connect timeout."""

    async def main() -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        async with LoopStalls() as stalls:
            pool = Http1Pool(
                limit=4, connect_s=0.2, read_idle_s=5.0, stalls=stalls if measured else None
            )
            try:
                connecting = asyncio.create_task(pool._acquire(("127.0.0.1", port, False)))
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
                listener.close()

    asyncio.run(main())


def test_a_probe_during_a_router_stall_is_answered() -> None:
    """A health or metrics probe on a new connection (aiohttp's session) while the router's
    loop is blocked for longer than both the connect and the probe timeout."""

    async def health(_: Request) -> Response:
        return Response("ok")

    async def main() -> None:
        app = Starlette(routes=[Route("/health", health)])
        async with serve(app) as url:
            upstream = Upstream(TimeoutsConfig(connect_s=0.2, health_s=0.2), LimitsConfig())
            await upstream.start()
            try:
                probing = asyncio.create_task(upstream.probe(url + "/health"))
                for _ in range(2):  # the probe's connect is under way
                    await asyncio.sleep(0)
                time.sleep(0.6)
                assert await probing == (200, b"ok")
            finally:
                await upstream.close()

    asyncio.run(main())
