"""Pooled, keep-alive HTTP client to the engines (aiohttp; chosen by bench/http_client_bench.py).

One `Upstream` per router process. Failures are mapped to two exceptions the proxy
understands: `UpstreamConnectError` (nothing was sent or the connection broke before a
response) and `UpstreamTimeout` (the engine went silent for longer than `read_idle_s`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from router.config import LimitsConfig, TimeoutsConfig


class UpstreamError(Exception):
    pass


class UpstreamConnectError(UpstreamError):
    pass


class UpstreamTimeout(UpstreamError):
    pass


class UpstreamResponse:
    """An open upstream response; the body is read with `read()` or `chunks()`."""

    __slots__ = ("_resp", "headers", "status")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.headers = resp.headers

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except TimeoutError as exc:
            raise UpstreamTimeout("upstream went silent") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamConnectError(f"upstream read failed: {exc}") from exc

    async def next_chunk(self) -> bytes:
        """The next piece of body as it arrives; b"" at the end."""
        try:
            return await self._resp.content.readany()
        except TimeoutError as exc:
            raise UpstreamTimeout("upstream went silent") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamConnectError(f"upstream stream broke: {exc}") from exc

    def abort(self) -> None:
        """Drop the connection (the engine sees a disconnect and cancels the request)."""
        self._resp.close()

    def release(self) -> None:
        """Return the connection to the pool (body fully read)."""
        self._resp.release()


class Upstream:
    def __init__(self, timeouts: TimeoutsConfig, limits: LimitsConfig) -> None:
        self._timeouts = timeouts
        self._limits = limits
        self._session: aiohttp.ClientSession | None = None
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=timeouts.connect_s, sock_read=timeouts.read_idle_s
        )
        self._probe_timeout = aiohttp.ClientTimeout(total=timeouts.health_s)

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self._limits.upstream_connections,
            limit_per_host=0,
            # below the engines' own idle timeout (vLLM's uvicorn: 5 s), so a pooled
            # connection is never reused just as the engine closes it
            keepalive_timeout=4.0,
            ttl_dns_cache=300,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def close(self) -> None:
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
        try:
            resp = await self.session.request(
                method, url, data=body, headers=headers, allow_redirects=False
            )
        except TimeoutError as exc:
            raise UpstreamTimeout(f"no response from {url}") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamConnectError(f"{type(exc).__name__}: {exc}") from exc
        return UpstreamResponse(resp)

    async def probe(self, url: str) -> tuple[int, bytes]:
        """GET with the probe timeout; returns (status, body). Raises UpstreamError."""
        try:
            async with self.session.get(url, timeout=self._probe_timeout) as resp:
                return resp.status, await resp.read()
        except TimeoutError as exc:
            raise UpstreamTimeout(f"probe {url} timed out") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamConnectError(f"probe {url}: {type(exc).__name__}: {exc}") from exc

    async def post_json(self, url: str, payload: Any, timeout_s: float) -> tuple[int, bytes]:
        """POST a JSON body with its own timeout; returns (status, body)."""
        try:
            async with self.session.post(
                url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                return resp.status, await resp.read()
        except TimeoutError as exc:
            raise UpstreamTimeout(f"{url} timed out") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamConnectError(f"{url}: {type(exc).__name__}: {exc}") from exc
