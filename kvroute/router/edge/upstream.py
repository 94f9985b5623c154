"""The router's HTTP client to the engines.

Proxied requests go through `Http1Pool` (kvroute/router/edge/http1.py: pooled keep-alive HTTP/1.1 on
httptools, a fraction of aiohttp's CPU per request; compared side by side by
bench/http_client_bench.py). Probes, metrics scrapes and render calls, which are few and
want total timeouts, use an aiohttp session. Failures are mapped to two exceptions the proxy
understands: `UpstreamConnectError` (nothing was sent or the connection broke before a
response) and `UpstreamTimeout` (the engine went silent for longer than `read_idle_s`), each
saying whether the request had been `sent`; `UpstreamPoolTimeout` when no pooled connection
came free in time.
Both verify https:// engines with one TLS context (`upstream_tls`: a CA bundle, and a name to
check when engines are addressed by IP).
Connect and total timeouts do not count stalls of the router's own event loop
(kvroute/router/fleet/loop_stall.py): a worker is not charged for the router's slowness.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from kvroute.router.config import LimitsConfig, TimeoutsConfig, UpstreamTlsConfig
from kvroute.router.edge.http1 import (
    Http1Pool,
    UpstreamConnectError,
    UpstreamError,
    UpstreamPoolTimeout,
    UpstreamResponse,
    UpstreamTimeout,
)
from kvroute.router.fleet.loop_stall import LoopStalls, wait_own_time

__all__ = [
    "Upstream",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamPoolTimeout",
    "UpstreamResponse",
    "UpstreamTimeout",
]


# Idle pooled connections are dropped before the engines' own idle timeout (vLLM's uvicorn
# closes after 5 s), so a connection is never reused just as the engine closes it.
_ENGINE_IDLE_S = 4.0


def tls_context(cfg: UpstreamTlsConfig) -> ssl.SSLContext:
    """A client context that verifies https:// engines against `cfg.ca_file` (or the system's
    roots); raises OSError or ssl.SSLError if the bundle cannot be loaded."""
    return ssl.create_default_context(cafile=cfg.ca_file)


class Upstream:
    def __init__(
        self,
        timeouts: TimeoutsConfig,
        limits: LimitsConfig,
        pool_wait_s: float = 5.0,
        tls: UpstreamTlsConfig | None = None,
    ) -> None:
        self._timeouts = timeouts
        self._limits = limits
        self._pool_wait_s = pool_wait_s
        self._tls_cfg = tls or UpstreamTlsConfig()
        # one context for the pool and the probes' session, so both trust the same roots
        self._tls = tls_context(self._tls_cfg)
        self._server_name = self._tls_cfg.server_name
        self._session: aiohttp.ClientSession | None = None
        self._pool: Http1Pool | None = None
        self.stalls = LoopStalls()  # the router's own stalls, kept out of worker timeouts

    async def start(self) -> None:
        self._pool = Http1Pool(
            limit=self._limits.upstream_connections,
            connect_s=self._timeouts.connect_s,
            read_idle_s=self._timeouts.read_idle_s,
            keepalive_s=_ENGINE_IDLE_S,
            stalls=self.stalls,
            wait_s=self._pool_wait_s,
            tls=self._tls,
            server_name=self._server_name,
        )
        connector = aiohttp.TCPConnector(
            limit=self._limits.upstream_connections,
            limit_per_host=0,
            keepalive_timeout=_ENGINE_IDLE_S,
            ttl_dns_cache=300,
            ssl=self._tls,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            # no wall-clock limits of its own: every call is bounded by wait_own_time, whose
            # clock leaves out this loop's stalls (aiohttp's sock_connect would not)
            timeout=aiohttp.ClientTimeout(total=None),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def close(self) -> None:
        await self.stalls.stop()
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Upstream.start() was not called")
        return self._session

    async def send(
        self,
        method: str,
        url: str,
        headers: Sequence[tuple[str, str]] | Mapping[str, str],
        body: bytes | None,
    ) -> UpstreamResponse:
        """Send a request; returns once the response status and headers are in."""
        if self._pool is None:
            raise RuntimeError("Upstream.start() was not called")
        return await self._pool.request(method, url, headers, body)

    async def probe(self, url: str) -> tuple[int, bytes]:
        """GET with the probe timeout; returns (status, body). Raises UpstreamError."""
        try:
            return await wait_own_time(self._get(url), self._timeouts.health_s, self.stalls)
        except TimeoutError as exc:
            raise UpstreamTimeout(f"probe {url} timed out") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamConnectError(f"probe {url}: {type(exc).__name__}: {exc}") from exc

    def _server_hostname(self, url: str) -> str | None:
        return self._server_name if url.startswith("https:") else None

    async def _get(self, url: str) -> tuple[int, bytes]:
        async with self.session.get(url, server_hostname=self._server_hostname(url)) as resp:
            return resp.status, await resp.read()

    async def _post(self, url: str, payload: Any) -> tuple[int, bytes]:
        async with self.session.post(
            url, json=payload, server_hostname=self._server_hostname(url)
        ) as resp:
            return resp.status, await resp.read()

    async def post_json(self, url: str, payload: Any, timeout_s: float) -> tuple[int, bytes]:
        """POST a JSON body with its own timeout; returns (status, body)."""
        try:
            return await wait_own_time(self._post(url, payload), timeout_s, self.stalls)
        except TimeoutError as exc:
            raise UpstreamTimeout(f"{url} timed out") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamConnectError(f"{url}: {type(exc).__name__}: {exc}") from exc
