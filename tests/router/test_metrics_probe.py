"""The /metrics probe over real HTTP on loopback: what the engine reports beyond this router's
own in-flight requests is counted as other routers' load, and nothing else is."""

from __future__ import annotations

import asyncio

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.config import BreakerConfig, LimitsConfig, TimeoutsConfig, WorkerSpec
from router.health import MetricsProbe
from router.upstream import Upstream
from router.workers import Worker, WorkerRegistry
from tests.router.fake_engine import serve

LABELS = 'engine="0",model_name="m"'


def exposition(running: int, waiting: int) -> str:
    return (
        f"vllm:num_requests_running{{{LABELS}}} {running}.0\n"
        f"vllm:num_requests_waiting{{{LABELS}}} {waiting}.0\n"
        f"vllm:kv_cache_usage_perc{{{LABELS}}} 0.25\n"
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
