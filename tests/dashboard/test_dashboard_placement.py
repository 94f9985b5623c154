"""The dashboard shows each worker's KV pool and working set, in a real headless browser
against the real `kvroute serve` and `kvroute sim fleet` processes of
tests/router/test_placement_process.py. Same browser rules as test_dashboard_browser.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dashboard.test_dashboard_browser import _need_browser, open_page
from tests.router.test_placement_process import (
    ADMIN,
    BLOCKS,
    Routers,
    _new_conversations,
    _workers,
    routers,
    wait_for_capacity,
)

__all__ = ["routers"]  # the module-scoped fixture, started once for this module

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]


def test_each_worker_shows_its_pool_and_working_set(routers: Routers, tmp_path: Path) -> None:
    _need_browser()
    assert all(c["tokens"] == BLOCKS * 16 for c in wait_for_capacity(routers).values())
    _new_conversations(routers.placement, routers.model, "dash", 6)
    want = {n: w["working_set"] for n, w in _workers(routers.placement).items()}
    assert sum(ws["conversations"] for ws in want.values()) == 6
    with open_page(tmp_path) as page:
        page.goto(f"{routers.placement}/dashboard#token={ADMIN}")
        page.locator("#workers tbody tr .working-set").nth(1).wait_for()
        rows = page.locator("#workers tbody tr").all()
        assert len(rows) == 2
        for row in rows:
            name = row.get_attribute("data-worker")
            assert name in want
            pool = row.locator(".capacity")
            assert pool.get_attribute("data-tokens") == str(BLOCKS * 16)
            assert f"pool {BLOCKS * 16:,} tokens" in pool.inner_text()
            ws = row.locator(".working-set")
            assert ws.get_attribute("data-conversations") == str(want[name]["conversations"])
            assert ws.get_attribute("data-tokens") == str(want[name]["tokens"])
            assert f"{want[name]['conversations']} conversations" in ws.inner_text()
            assert "most blocks seen" in row.locator("td.pool").inner_text()
            assert row.locator(".cpu-tier").count() == 0  # the CPU-tier rate is not learned
