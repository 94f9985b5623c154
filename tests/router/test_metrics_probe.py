"""The /metrics probe over real HTTP on loopback: what the engine reports beyond this router's
own in-flight requests is counted as other routers' load, and nothing else is."""

from __future__ import annotations

import asyncio

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvroute.router.config import BreakerConfig, LimitsConfig, TimeoutsConfig, WorkerSpec
from kvroute.router.edge.upstream import Upstream
from kvroute.router.fleet.health import MetricsProbe
from kvroute.router.fleet.load import ScrapeBackoff
from kvroute.router.fleet.workers import Worker, WorkerRegistry
from tests.router.fake_engine import serve

LABELS = 'engine="0",model_name="m"'


def exposition(running: int, waiting: int, kv_usage: float = 0.25) -> str:
    return (
        f"vllm:num_requests_running{{{LABELS}}} {running}.0\n"
        f"vllm:num_requests_waiting{{{LABELS}}} {waiting}.0\n"
        f"vllm:kv_cache_usage_perc{{{LABELS}}} {kv_usage}\n"
    )


def engine_app(worker_box: list[Worker], sent_during_scrape: int, foreign: int) -> Starlette:
    """An engine whose /metrics sees `sent_during_scrape` of this router's requests that the
    router dispatched while the scrape was on its way, plus `foreign` of another router's."""

    async def metrics(_: Request) -> Response:
        worker = worker_box[0]
        for _ in range(sent_during_scrape):  # dispatched now, reaching the engine first
            worker.load.running += 1
            worker.load.prefilling += 1
        own = worker.load.running  # all of them still waiting for their prefill
        await asyncio.sleep(0)
        return Response(exposition(0, own + foreign), media_type="text/plain")

    return Starlette(routes=[Route("/metrics", metrics)])


async def scrape(sent_during_scrape: int, foreign: int, already_running: int) -> Worker:
    box: list[Worker] = []
    async with serve(engine_app(box, sent_during_scrape, foreign)) as url:
        worker = WorkerRegistry(BreakerConfig()).add(WorkerSpec(name="w0", url=url))
        worker.load.running = worker.load.prefilling = already_running
        box.append(worker)
        upstream = Upstream(TimeoutsConfig(), LimitsConfig())
        await upstream.start()
        try:
            await MetricsProbe(upstream, clock=lambda: 100.0)(worker)
        finally:
            await upstream.close()
    return worker


def test_a_request_sent_during_the_scrape_is_not_another_routers_load() -> None:
    worker = asyncio.run(scrape(sent_during_scrape=2, foreign=0, already_running=1))
    m = worker.load.engine
    assert m is not None and m.waiting == 3 and m.kv_usage == 0.25
    assert worker.load.others(100.0, stale_after=5.0) == (0, 0)


def test_another_routers_requests_are_counted() -> None:
    worker = asyncio.run(scrape(sent_during_scrape=1, foreign=3, already_running=2))
    assert worker.load.others(100.0, stale_after=5.0) == (3, 3)
    assert worker.load.others(106.0, stale_after=5.0) == (0, 0)  # stale: ignored


def scrape_times(kv_usage: float, foreign_from: float | None) -> list[float]:
    """When the probe read an engine's /metrics over 40 s of a clock it runs at every second
    (as the periodic job does); from `foreign_from` on the engine also has another router's
    requests."""
    foreign = [0]
    scrapes: list[float] = []
    now = [0.0]

    async def metrics(_: Request) -> Response:
        scrapes.append(now[0])
        return Response(exposition(0, foreign[0], kv_usage), media_type="text/plain")

    async def go() -> None:
        app = Starlette(routes=[Route("/metrics", metrics)])
        async with serve(app) as url:
            worker = WorkerRegistry(BreakerConfig()).add(WorkerSpec(name="w0", url=url))
            upstream = Upstream(TimeoutsConfig(), LimitsConfig())
            await upstream.start()
            probe = MetricsProbe(
                upstream, clock=lambda: now[0], base_s=1.0, max_s=8.0, kv_quiet_below=0.9
            )
            try:
                for t in range(0, 40):
                    now[0] = float(t)
                    if foreign_from is not None and t >= foreign_from:
                        foreign[0] = 2
                    await probe(worker)
            finally:
                await upstream.close()

    asyncio.run(go())
    return scrapes


def test_quiet_scrapes_back_off_and_news_resets_the_period() -> None:
    """An engine whose pages show nothing new is read every 1, 2, 4, 8, 8 s; once another
    router's requests show up, every second again."""
    scrapes = scrape_times(kv_usage=0.25, foreign_from=25)
    assert scrapes[:6] == [0.0, 1.0, 3.0, 7.0, 15.0, 23.0]
    # the first scrape after t=25 sees the other router's requests: back to every second
    after = [t for t in scrapes if t > 25]
    assert after[0] == 31.0 and after[1:4] == [32.0, 33.0, 34.0]


def test_high_kv_usage_keeps_the_base_period() -> None:
    assert scrape_times(kv_usage=0.95, foreign_from=None) == [float(t) for t in range(40)]


def test_scrape_backoff_doubles_up_to_the_cap_and_resets() -> None:
    s = ScrapeBackoff()
    assert s.due(0.0)
    s.scraped(0.0, quiet=True, base_s=1.0, max_s=16.0)  # the first reading sets the base
    assert not s.due(0.5) and s.due(1.0)
    for t, expect in ((1.0, 2.0), (3.0, 4.0), (7.0, 8.0), (15.0, 16.0), (31.0, 16.0)):
        s.scraped(t, quiet=True, base_s=1.0, max_s=16.0)
        assert s.interval == expect
    s.scraped(47.0, quiet=False, base_s=1.0, max_s=16.0)
    assert s.interval == 1.0 and s.due(48.0)
