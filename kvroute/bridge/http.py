"""The bridge's HTTP side: `/metrics` (Prometheus), `/health` (JSON), `/livez` (the process
should keep running: 503 once a follower keeps failing), `/readyz` and `/ready` (every
followed engine is connected)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from kvroute.bridge.metrics import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from kvroute.bridge.app import Bridge


def make_app(bridge: Bridge) -> web.Application:
    """The aiohttp application serving `bridge`'s metrics, health and readiness."""

    async def metrics(_: web.Request) -> web.Response:
        response = web.Response(body=bridge.metrics.render())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def health(_: web.Request) -> web.Response:
        # Healthy while the process runs, even if the engine is not up yet (see "ready").
        return web.json_response(bridge.health())

    async def livez(_: web.Request) -> web.Response:
        return web.json_response({"alive": bridge.alive}, status=200 if bridge.alive else 503)

    async def ready(_: web.Request) -> web.Response:
        return web.json_response({"ready": bridge.ready}, status=200 if bridge.ready else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/readyz", ready)
    app.router.add_get("/livez", livez)
    return app


async def start_http(listen: str, bridge: Bridge) -> tuple[web.AppRunner, int]:
    """Serve the app on "host:port" (port 0 = ephemeral); returns the runner and port."""
    host, _, port = listen.rpartition(":")
    runner = web.AppRunner(make_app(bridge), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host.strip("[]") or "127.0.0.1", int(port))
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else int(port)
    return runner, int(bound)
