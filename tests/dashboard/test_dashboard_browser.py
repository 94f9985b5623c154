"""The dashboard in a real headless browser, against a real router and simulated fleet.

Debian's Chromium (/usr/bin/chromium, `make test` installs it) driven by Playwright over its
pipe protocol; never a Playwright-downloaded browser. The router, the two simulated engines
and their bridges are real processes on loopback (the demo's launcher). Without Chromium
the tests skip, unless KVROUTE_REQUIRE_BROWSER=1 (as in `make test`), where they fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvroute.demo.run import LiveRun, start_live
from kvroute.demo.workload import SHORT

CHROMIUM = Path(os.environ.get("KVROUTE_CHROMIUM", "/usr/bin/chromium"))
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
MODEL = "kvroute-sim"
TIMEOUT_MS = 20_000

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]


def _need_browser() -> None:
    missing = not CHROMIUM.exists()
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing = True
    if missing:
        if os.environ.get("KVROUTE_REQUIRE_BROWSER"):
            pytest.fail(f"KVROUTE_REQUIRE_BROWSER is set but {CHROMIUM} or playwright is missing")
        pytest.skip(f"needs {CHROMIUM} and playwright (make test installs both)")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    run = start_live(SHORT, "kvroute", tmp_path_factory.mktemp("fleet"))
    try:
        yield run
    finally:
        run.stop()


@contextlib.contextmanager
def open_page(tmp_path: Path) -> Iterator[Any]:
    """A headless Chromium page with a fresh profile; fails if the page raised a JavaScript
    error by the time the block ends."""
    _need_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        # A fresh profile per test: launch_persistent_context passes --user-data-dir.
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=str(CHROMIUM),
            args=FLAGS,
            headless=True,
            viewport={"width": 1400, "height": 1000},
        )
        ctx.set_default_timeout(TIMEOUT_MS)
        try:
            pg = ctx.new_page()
            errors: list[str] = []
            pg.on("pageerror", lambda exc: errors.append(str(exc)))
            yield pg
            assert not errors, f"JavaScript errors on the page: {errors}"
        finally:
            ctx.close()


@pytest.fixture()
def page(tmp_path: Path) -> Iterator[Any]:
    with open_page(tmp_path) as pg:
        yield pg


def _chat(content: str) -> dict[str, Any]:
    system = "You are a helpful assistant. " * 40  # a few hundred tokens to reuse
    return {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": content},
        ],
    }


def test_loads_shows_fleet_updates_and_scores(live: LiveRun, page: Any) -> None:
    page.goto(f"{live.url}/dashboard#token={live.token}")

    # The fleet: one row per worker, healthy, with its event stream live.
    rows = page.locator("#workers tbody tr")
    rows.nth(SHORT.workers - 1).wait_for()
    assert rows.count() == SHORT.workers
    names = sorted(rows.nth(i).get_attribute("data-worker") for i in range(rows.count()))
    assert names == [f"sim-{i}" for i in range(SHORT.workers)]
    page.wait_for_function(
        "() => [...document.querySelectorAll('#workers tbody tr')].every("
        "r => r.textContent.includes('ready') && r.textContent.includes('live'))"
    )
    # The token left the address bar and lives in this tab's sessionStorage only.
    assert "token" not in page.url
    assert page.evaluate("sessionStorage.getItem('kvroute.adminToken')") == live.token

    # A request routed through the router shows up as a decision, with per-worker scores.
    body = _chat("first question about routing")
    resp = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=30.0)
    assert resp.status_code == 200
    worker = resp.headers["x-kvroute-worker"]
    decision = page.locator("#decisions tbody tr").first
    decision.wait_for()
    page.wait_for_function(
        "w => { const r = document.querySelector('#decisions tbody tr');"
        " return r && r.children[3].textContent === w"
        " && !r.children[6].textContent.includes('…'); }",
        arg=worker,
    )
    chips = decision.locator(".score")
    assert chips.count() == SHORT.workers
    assert decision.locator(".score.chosen").inner_text().startswith(worker)
    # A plain chat request went to the engine as its token ids (the fleet's send_token_ids).
    assert decision.locator("td").nth(2).locator(".as-ids").count() == 1
    reported = decision.locator("td").nth(6).inner_text()
    usage = resp.json()["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert reported.replace(",", "") == str(cached)

    # Paste the same conversation: the worker that served it is predicted to reuse it, the
    # others (fresh caches) nothing.
    page.fill("#score-input", json.dumps(body["messages"]))
    page.click("#score-form button[type=submit]")
    page.locator("#score-table tbody tr").nth(SHORT.workers - 1).wait_for()
    reuse = {
        r.get_attribute("data-worker"): r.locator("td.reuse").get_attribute("data-reuse")
        for r in page.locator("#score-table tbody tr").all()
    }
    assert int(reuse[worker] or 0) > 200
    assert all(int(v or 0) == 0 for w, v in reuse.items() if w != worker)
    summary = page.locator("#score-summary").inner_text()
    assert re.search(r"would choose " + re.escape(worker), summary)
    # Group kinds of the hybrid model are named (learned from the score answer).
    page.wait_for_function(
        "() => document.querySelector('#workers tbody').textContent.includes('sliding_window')"
    )
    # A streamed answer ticks its worker's step clock: the row shows the learned step period.
    streamed = {**_chat("tell me more"), "max_tokens": 24, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", f"{live.url}/v1/chat/completions", json=streamed, timeout=30.0
    ) as sresp:
        assert sresp.status_code == 200
        stepped = sresp.headers["x-kvroute-worker"]
        for _ in sresp.iter_bytes():
            pass
    page.wait_for_function(
        "w => { const r = document.querySelector(`#workers tbody tr[data-worker='${w}']`);"
        " return r && /step \\d+\\.\\d ms/.test(r.textContent); }",
        arg=stepped,
    )
    if os.environ.get("KVROUTE_DASHBOARD_SCREENSHOT"):
        page.screenshot(path=os.environ["KVROUTE_DASHBOARD_SCREENSHOT"], full_page=True)


def test_asks_for_the_token_and_rejects_a_wrong_one(live: LiveRun, page: Any) -> None:
    page.goto(f"{live.url}/dashboard")
    page.locator("#login").wait_for(state="visible")
    assert page.locator("#main").is_hidden()

    page.fill("#token-input", "not-the-token")
    page.click("#login-form button[type=submit]")
    page.wait_for_function("() => document.getElementById('login-error').textContent.length > 0")
    assert "token" in page.locator("#login-error").inner_text()
    assert page.evaluate("sessionStorage.getItem('kvroute.adminToken')") is None

    page.fill("#token-input", live.token)
    page.click("#login-form button[type=submit]")
    page.locator("#workers tbody tr").first.wait_for()
    assert page.locator("#login").is_hidden()
    page.wait_for_function("() => document.getElementById('status').dataset.state === 'live'")


def test_static_files_are_served_with_safe_headers(live: LiveRun) -> None:
    page = httpx.get(f"{live.url}/dashboard", timeout=5.0)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    js = httpx.get(f"{live.url}/dashboard/dashboard.js", timeout=5.0)
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert httpx.get(f"{live.url}/dashboard/../admin/workers", timeout=5.0).status_code in (
        401,
        403,
        404,
    )
    assert httpx.get(f"{live.url}/dashboard/secret.txt", timeout=5.0).status_code == 404
    # The data stays behind the token.
    assert httpx.get(f"{live.url}/admin/workers", timeout=5.0).status_code == 401
