"""The dashboard shows reuse per KV tier, in a real headless browser against a real
`kvroute serve` whose bridges report a worker holding the prompts in its CPU tier (the fleet
of tests/router/test_tier_serve.py). Same browser rules as test_dashboard_browser.py."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.instant_engine import running_engine
from tests.dashboard.test_dashboard_browser import _need_browser, open_page
from tests.router.test_tier_serve import ADMIN, PROMPTS, tier_router

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]


@pytest.fixture()
def router_url(tmp_path: Path) -> Iterator[str]:
    """The tiered fleet's router, run on an event loop of its own thread."""
    _need_browser()
    ready: list[str] = []
    failed: list[BaseException] = []
    stop = threading.Event()

    async def serve(engine: str) -> None:
        async with tier_router(engine, tmp_path / "router.yaml") as http:
            resp = await http.post(
                "/v1/completions", json={"model": "m", "prompt": PROMPTS["b"], "max_tokens": 1}
            )
            assert resp.status_code == 200, resp.text
            ready.append(str(http.base_url).rstrip("/"))
            while not stop.is_set():
                await asyncio.sleep(0.05)

    def run(engine: str) -> None:
        try:
            asyncio.run(serve(engine))
        except BaseException as exc:  # reported by the fixture
            failed.append(exc)

    with running_engine() as engine:
        thread = threading.Thread(target=run, args=(engine,), daemon=True)
        thread.start()
        while not ready and not failed and thread.is_alive():
            thread.join(0.1)
        try:
            if failed:
                raise failed[0]
            yield ready[0]
        finally:
            stop.set()
            thread.join(30)


def test_decisions_and_scores_show_tokens_per_tier(router_url: str, tmp_path: Path) -> None:
    n = len(PROMPTS["b"]) - 1
    with open_page(tmp_path) as page:
        page.goto(f"{router_url}/dashboard#token={ADMIN}")
        # the routed request's decision: w1 chosen, its CPU tokens named on its chip
        chosen = page.locator("#decisions tbody tr").first.locator(".score.chosen")
        chosen.wait_for()
        text = chosen.inner_text()
        assert text.startswith("w1") and f"+ {n:,} CPU" in text
        # scoring prompt A (w1 has it in CPU memory, w2 on GPU; prompt B, just routed to
        # w1, is expected on its GPU now): the reuse cell names the CPU tier's tokens
        body: dict[str, Any] = {"model": "m", "prompt": PROMPTS["a"]}
        page.fill("#score-input", json.dumps(body))
        page.click("#score-form button[type=submit]")
        page.locator("#score-table tbody tr").nth(2).wait_for()
        cells = {
            r.get_attribute("data-worker"): r.locator("td.reuse")
            for r in page.locator("#score-table tbody tr").all()
        }
        assert cells["w1"].get_attribute("data-cpu") == str(n)
        assert f"+ {n:,} CPU" in cells["w1"].inner_text()
        for other in ("w0", "w2"):
            assert cells[other].get_attribute("data-cpu") == "0"
            assert "CPU" not in cells[other].inner_text()
