"""The dashboard shows both halves of a disaggregated request: a real headless browser on a
real router in front of a simulated prefill/decode fleet (tests/router/pd_rig.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.dashboard.test_dashboard_browser import _need_browser, open_page
from tests.router.pd_rig import ADMIN, PdRig, pd_rig

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdRig]:
    _need_browser()
    with pd_rig(tmp_path_factory.mktemp("pd-dashboard")) as r:
        yield r


@pytest.fixture()
def page(tmp_path: Path) -> Iterator[Any]:
    with open_page(tmp_path) as pg:
        yield pg


def test_decisions_show_prefill_and_decode_workers_and_roles(rig: PdRig, page: Any) -> None:
    page.goto(f"{rig.url}/dashboard#token={ADMIN}")
    body = {"model": rig.model, "prompt": "Show me both halves. " * 20, "max_tokens": 4}
    resp = httpx.post(rig.url + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 200
    pd = rig.last()["pd"]
    prefill, decode = pd["prefill"][-1]["worker"], pd["decode"][-1]["worker"]
    page.wait_for_function(
        "t => { const r = document.querySelector('#decisions tbody tr');"
        " return r && r.children[3].textContent === t; }",
        arg=f"{prefill} → {decode}",
    )
    cell = page.locator("#decisions tbody tr").first.locator("td").nth(3)
    title = cell.get_attribute("title") or ""
    assert f"prefill: {prefill} 200" in title and f"decode: {decode} 200" in title
    # the fleet table names each worker's role
    row = page.locator(f"#workers tbody tr[data-worker='{decode}']")
    row.wait_for()
    assert "decode worker" in row.inner_text().lower()
    mixed = page.locator("#workers tbody tr[data-worker='sim-0']").inner_text().lower()
    assert "worker" not in mixed.replace("sim-0", "")
