"""Start fake engines and a router on loopback ports, all in one event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from kvroute.router.app import Components, create_app
from kvroute.router.config import RouterConfig
from kvroute.router.config_load import config_from_dict
from kvroute.router.routing.index_view import IndexView
from tests.router.fake_engine import EngineScript, make_engine, serve
from tests.router.fakes import ScriptedIndex

ADMIN = "test-admin-token"


@dataclass
class Rig:
    url: str
    client: httpx.AsyncClient
    engines: dict[str, EngineScript]
    engine_urls: dict[str, str]
    parts: Components
    index: Any
    servers: dict[str, Any]

    async def kill(self, name: str) -> None:
        """Stop engine `name` (its port then refuses connections)."""
        server = self.servers[name]
        server.should_exit = True
        while server.started and server.servers and any(s.is_serving() for s in server.servers):
            await asyncio.sleep(0.01)

    def admin_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {ADMIN}"}


def router_config(workers: list[dict[str, Any]], **extra: Any) -> RouterConfig:
    data: dict[str, Any] = {
        "workers": workers,
        "models": {"m": {"tokenizer": "render"}},
        "admin": {"token": ADMIN},
        "health": {"interval_s": 0.2, "unhealthy_after": 1, "healthy_after": 1},
        "load": {"metrics_interval_s": 0},
        "retry": {"backoff_initial_s": 0.001, "backoff_max_s": 0.005},
    }
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return config_from_dict(data)


@contextlib.asynccontextmanager
async def rig(
    n: int = 2,
    *,
    extra_workers: list[dict[str, Any]] | None = None,
    index: IndexView | None = None,
    bridges: dict[str, str] | None = None,
    **config: Any,
) -> AsyncIterator[Rig]:
    """n fake engines w0..w(n-1) plus a router in front of them."""
    scripts = {f"w{i}": EngineScript(f"w{i}") for i in range(n)}
    async with contextlib.AsyncExitStack() as stack:
        urls = {}
        servers: dict[str, Any] = {}
        for name, script in scripts.items():
            keep: list[Any] = []
            urls[name] = await stack.enter_async_context(serve(make_engine(script), keep=keep))
            servers[name] = keep[0]
        workers: list[dict[str, Any]] = [{"name": name, "url": url} for name, url in urls.items()]
        for w in workers:
            if bridges and w["name"] in bridges:
                w["bridge"] = bridges[w["name"]]
        workers += extra_workers or []
        cfg = router_config(workers, **config)
        idx = index if index is not None else ScriptedIndex()
        app = create_app(cfg, index=idx)
        # as `kvroute serve` runs it: uvicorn must not rewrite the peer from X-Forwarded-For
        url = await stack.enter_async_context(serve(app, loop="asyncio", proxy_headers=False))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=10))
        yield Rig(url, client, scripts, urls, app.state.kvroute, idx, servers)
