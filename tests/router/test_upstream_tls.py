"""https:// workers: the router speaks TLS to a real TLS engine on loopback (certificates from a
throwaway CA), for proxied requests and for its probes and render calls, and refuses engines
whose certificate it cannot verify."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvroute.router.config_load import ConfigError, config_from_dict
from kvroute.router.edge.http1 import Http1Pool, UpstreamConnectError
from tests.common.throwaway_pki import Pki, make_pki
from tests.router.fake_engine import EngineScript, make_engine, serve
from tests.router.harness import rig

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello over tls"}]}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@contextlib.asynccontextmanager
async def tls_engine(pki: Pki, script: EngineScript) -> AsyncIterator[str]:
    """A fake engine behind uvicorn's TLS; yields its https:// URL on 127.0.0.1."""
    tls = {"ssl_certfile": pki.server_cert, "ssl_keyfile": pki.server_key}
    async with serve(make_engine(script), **tls) as url:
        yield url.replace("http://", "https://", 1)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_requests_and_probes_reach_a_tls_engine(pki: Pki) -> None:
    async def go() -> None:
        script = EngineScript("secure")
        async with tls_engine(pki, script) as url:
            worker = {"name": "secure", "url": url}
            async with rig(0, extra_workers=[worker], upstream_tls={"ca_file": pki.ca}) as r:
                listing = (await r.client.get("/admin/workers", headers=r.admin_headers())).json()
                (w,) = listing["workers"]
                assert w["healthy"] is True and w["models"] == ["m"]  # probes over TLS
                for stream in (False, True):
                    resp = await r.client.post(
                        "/v1/chat/completions", json={**CHAT, "stream": stream}
                    )
                    assert resp.status_code == 200, resp.text
                assert len(script.received) == 2
                # the pooled connection is reused for the next request
                pool = r.parts.upstream._pool
                assert pool is not None and pool.idle_connections() == 1
                resp = await r.client.post("/v1/chat/completions", json=CHAT)
                assert resp.status_code == 200 and pool.open_connections == 1

    run(go())


def test_an_engine_signed_by_another_ca_is_refused(pki: Pki) -> None:
    async def go() -> None:
        script = EngineScript("secure")
        async with tls_engine(pki, script) as url:
            worker = {"name": "secure", "url": url, "model": "m"}
            cfg = {"ca_file": pki.other_ca}
            async with rig(0, extra_workers=[worker], upstream_tls=cfg) as r:
                (w,) = (await r.client.get("/admin/workers", headers=r.admin_headers())).json()[
                    "workers"
                ]
                assert w["healthy"] is False and "certificate" in (w["health_error"] or "").lower()
                resp = await r.client.post("/v1/chat/completions", json=CHAT)
                assert resp.status_code in (502, 503)
                assert script.received == []

    run(go())


def test_server_name_replaces_the_host_in_the_check(pki: Pki) -> None:
    async def go() -> None:
        script = EngineScript("secure")
        async with tls_engine(pki, script) as url:
            # the certificate names 127.0.0.1 and localhost: "localhost" passes, another fails
            for name, ok in (("localhost", True), ("engine.example", False)):
                tls = ssl.create_default_context(cafile=pki.ca)
                pool = Http1Pool(limit=2, connect_s=5, read_idle_s=5, tls=tls, server_name=name)
                try:
                    if ok:
                        resp = await pool.request("GET", url + "/health", {}, None)
                        assert resp.status == 200
                        await resp.read()
                        resp.release()
                    else:
                        with pytest.raises(UpstreamConnectError, match=r"(?i)certificate|hostname"):
                            await pool.request("GET", url + "/health", {}, None)
                finally:
                    await pool.close()

    run(go())


def test_a_missing_ca_bundle_is_a_config_error(tmp_path: Path) -> None:
    base = {"workers": [{"name": "w", "url": "https://127.0.0.1:1"}]}
    with pytest.raises(ConfigError, match=r"upstream_tls\.ca_file: no such file"):
        config_from_dict({**base, "upstream_tls": {"ca_file": str(tmp_path / "none.pem")}})
    assert config_from_dict(base).workers[0].url.startswith("https://")
