"""/livez and /readyz against a live router on loopback: liveness never follows the fleet."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.router.harness import rig


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _wait_status(client: Any, path: str, status: int, deadline_s: float = 5.0) -> Any:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while True:
        resp = await client.get(path)
        if resp.status_code == status or loop.time() > end:
            return resp
        await asyncio.sleep(0.05)


def test_fleet_outage_makes_readyz_503_while_livez_stays_200() -> None:
    async def go() -> None:
        async with rig(2) as r:
            assert (await r.client.get("/livez")).status_code == 200
            ready = await r.client.get("/readyz")
            assert ready.status_code == 200, ready.text
            assert ready.json()["ready_workers"] == 2
            for name in ("w0", "w1"):
                await r.kill(name)  # the whole fleet goes away
            down = await _wait_status(r.client, "/readyz", 503)
            assert down.status_code == 503, down.text
            assert down.json()["ready_workers"] == 0
            assert down.json()["models_without_ready_worker"] == ["m"]
            live = await r.client.get("/livez")
            assert live.status_code == 200 and live.json() == {"status": "ok"}
            assert (await r.client.get("/health")).status_code == 503  # unchanged meaning

    run(go())


def test_readyz_recovers_when_a_worker_is_healthy_again() -> None:
    async def go() -> None:
        async with rig(1) as r:
            r.engines["w0"].healthy = False
            assert (await _wait_status(r.client, "/readyz", 503)).status_code == 503
            assert (await r.client.get("/livez")).status_code == 200
            r.engines["w0"].healthy = True
            assert (await _wait_status(r.client, "/readyz", 200)).status_code == 200

    run(go())


def test_readyz_needs_a_ready_worker_for_every_configured_model() -> None:
    async def go() -> None:
        models = {"m": {"tokenizer": "render"}, "other": {"tokenizer": "render"}}
        async with rig(1, models=models) as r:
            resp = await r.client.get("/readyz")
            assert resp.status_code == 503
            assert resp.json()["models_without_ready_worker"] == ["other"]
            assert resp.json()["ready_workers"] == 1
            assert (await r.client.get("/health")).status_code == 200
            assert (await r.client.get("/livez")).status_code == 200

    run(go())
