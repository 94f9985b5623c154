"""The dashboard shows reuse per KV tier, and each worker's CPU-tier rate when the router
learns it, in a real headless browser against a real `kvroute serve` whose bridges report a
worker holding the prompts in its CPU tier (the fleet of tests/router/test_tier_serve.py).
Same browser rules as test_dashboard_browser.py."""

from __future__ import annotations

import asyncio
import contextlib
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


@contextlib.contextmanager
def serving(tmp_path: Path, policy: dict[str, Any] | None = None) -> Iterator[str]:
    """The tiered fleet's router, with the `policy` settings given, run on an event loop of
    its own thread; yields its URL."""
    _need_browser()
    ready: list[str] = []
    failed: list[BaseException] = []
    stop = threading.Event()

    async def serve(engine: str) -> None:
        async with tier_router(engine, tmp_path / "router.yaml", policy) as http:
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


@pytest.fixture()
def router_url(tmp_path: Path) -> Iterator[str]:
    with serving(tmp_path) as url:
        yield url


@pytest.fixture()
def learning_router_url(tmp_path: Path) -> Iterator[str]:
    """The router learning each worker's CPU-tier rate (the instant engine reports no loads
    to learn from: every worker is priced at the configured rate)."""
    with serving(tmp_path, {"learn_cpu_tier_rate": True}) as url:
        yield url


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


def test_each_workers_cpu_tier_rate_shows_when_the_router_learns_it(
    learning_router_url: str, tmp_path: Path
) -> None:
    """w2 as the router answers (the configured rate); w1 rewritten to carry a learned rate;
    w0 rewritten to carry none, as a router that does not learn the rate answers."""

    def rewrite(route: Any) -> None:
        resp = route.fetch()
        data = resp.json()
        for w in data["workers"]:
            if w["name"] == "w1":
                w["load"]["cpu_tier_tokens_per_s"] = 48_000.0
                w["load"]["cpu_tier_tokens_per_s_learned"] = 48_000.4
            elif w["name"] == "w0":
                assert w["load"]["cpu_tier_tokens_per_s"] == 200_000.0
                w["load"]["cpu_tier_tokens_per_s"] = None
        route.fulfill(response=resp, json=data)

    with open_page(tmp_path) as page:
        page.route("**/admin/workers", rewrite)
        page.goto(f"{learning_router_url}/dashboard#token={ADMIN}")
        page.locator("#workers tbody tr .cpu-tier").nth(1).wait_for()
        rows = {r.get_attribute("data-worker"): r for r in page.locator("#workers tbody tr").all()}
        assert sorted(rows) == ["w0", "w1", "w2"]
        assert rows["w0"].locator(".cpu-tier").count() == 0
        learned = rows["w1"].locator(".cpu-tier")
        assert learned.get_attribute("data-learned") == "true"
        assert learned.get_attribute("data-tokens-per-s") == "48000"
        assert learned.inner_text() == "CPU tier 48,000 tokens/s learned"
        configured = rows["w2"].locator(".cpu-tier")
        assert configured.get_attribute("data-learned") == "false"
        assert configured.get_attribute("data-tokens-per-s") == "200000"
        assert configured.inner_text() == "CPU tier 200,000 tokens/s configured"
