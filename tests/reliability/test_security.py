"""Security at the edge, against a real `kvroute serve` process: the admin API refuses requests
without the right token, internal and hop-by-hop headers from clients never reach an engine
nor steer the router, request size limits hold on every endpoint (413, declared or chunked),
and one tenant's `cache_salt` never yields another tenant's cache, end to end through
simulated engines (neither predicted by the router nor reused by the engine)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from bench.loopback import ADMIN_TOKEN, Loopback
from bench.traffic import completion_body, eventually, post_json, predictions, score, session
from tests.reliability.workload import documents
from tests.router.fake_engine import EngineScript, make_engine, serve

ADMIN_ROUTES = [
    ("GET", "/admin/workers"),
    ("POST", "/admin/workers"),
    ("GET", "/admin/workers/w0"),
    ("DELETE", "/admin/workers/w0"),
    ("POST", "/admin/workers/w0/drain"),
    ("POST", "/admin/workers/w0/undrain"),
    ("POST", "/admin/workers/w0/resync"),
    ("GET", "/admin/decisions"),
    ("POST", "/admin/score"),
]


def _fake_fleet_config(lb: Loopback, urls: dict[str, str], **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "workers": [{"name": n, "url": u, "model": "m"} for n, u in urls.items()],
        "models": {"m": {}},
        "health": {"interval_s": 0.2},
        "load": {"metrics_interval_s": 0},
        "log_level": "warning",
    }
    config.update(extra)
    return config


@pytest.mark.timeout(60)
def test_admin_refuses_missing_or_wrong_tokens_and_is_off_without_one() -> None:
    async def main(lb: Loopback) -> None:
        script = EngineScript("w0")
        async with serve(make_engine(script)) as url, session() as http:
            # (started from a thread: the fake engines share this event loop)
            with_token = await asyncio.to_thread(
                lb.router, _fake_fleet_config(lb, {"w0": url}, admin={"token": ADMIN_TOKEN}), "a"
            )
            without = await asyncio.to_thread(
                lb.router, _fake_fleet_config(lb, {"w0": url}), "without-token"
            )
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            for method, path in ADMIN_ROUTES:
                for headers, want in (
                    ({}, 401),
                    ({"authorization": "Bearer wrong"}, 401),
                    ({"authorization": f"Basic {ADMIN_TOKEN}"}, 401),
                    ({"authorization": f"Bearer {ADMIN_TOKEN}x"}, 401),
                    ({"authorization": "Bearer"}, 401),
                ):
                    status, data, _ = await post_json(
                        http, with_token.url + path, body, headers, method
                    )
                    assert status == want, (method, path, headers, status, data)
                    assert data["error"]["type"] == "authentication_error"
                status, data, _ = await post_json(
                    http,
                    without.url + path,
                    body,
                    {"authorization": f"Bearer {ADMIN_TOKEN}"},
                    method,
                )
                assert status == 403 and data["error"]["type"] == "permission_error"
            # nothing was changed by the refused calls
            status, data, _ = await post_json(
                http, with_token.url + "/admin/workers", None,
                {"authorization": f"Bearer {ADMIN_TOKEN}"}, "GET",
            )  # fmt: skip
            assert status == 200 and [w["state"] for w in data["workers"]] == ["active"]

    with Loopback() as lb:
        asyncio.run(main(lb))


@pytest.mark.timeout(60)
def test_internal_and_hop_by_hop_headers_are_stripped_and_cannot_steer() -> None:
    async def main(lb: Loopback) -> None:
        scripts = {n: EngineScript(n) for n in ("w0", "w1")}
        async with (
            serve(make_engine(scripts["w0"])) as u0,
            serve(make_engine(scripts["w1"])) as u1,
            session() as http,
        ):
            router = await asyncio.to_thread(
                lb.router,
                _fake_fleet_config(lb, {"w0": u0, "w1": u1}, policy={"name": "round_robin"}),
            )
            sneaky = {
                "x-kvroute-worker": "w1",
                "X-KVROUTE-Predicted-Cached-Tokens": "999",
                "x-kvroute-anything": "1",
                "proxy-authorization": "Basic c2VjcmV0",
                "authorization": "Bearer engine-key",
                "x-request-id": "keep-me",
            }
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            for _ in range(6):
                status, _, _ = await post_json(
                    http, router.url + "/v1/chat/completions", body, sneaky
                )
                assert status == 200
            received = [r for s in scripts.values() for r in s.received]
            assert len(received) == 6
            for r in received:
                assert not any(k.lower().startswith("x-kvroute-") for k in r.headers), r.headers
                assert "proxy-authorization" not in {k.lower() for k in r.headers}
                assert r.headers.get("authorization") == "Bearer engine-key"
                assert r.headers.get("x-request-id") == "keep-me"
            # the header naming w1 did not steer: round robin still used both
            chat = [
                len([r for r in s.received if r.path.endswith("/completions")])
                for s in scripts.values()
            ]
            assert all(n > 0 for n in chat), chat

    with Loopback() as lb:
        asyncio.run(main(lb))


async def _chunked(data: bytes) -> AsyncIterator[bytes]:
    for i in range(0, len(data), 4096):
        yield data[i : i + 4096]


@pytest.mark.timeout(60)
def test_request_size_limits_hold_on_every_endpoint() -> None:
    async def main(lb: Loopback) -> None:
        script = EngineScript("w0")
        async with serve(make_engine(script)) as url, session() as http:
            limit = 8192
            router = await asyncio.to_thread(
                lb.router,
                _fake_fleet_config(
                    lb, {"w0": url}, limits={"max_body_bytes": limit}, admin={"token": ADMIN_TOKEN}
                ),
            )
            big = ('{"model": "m", "prompt": "' + "a" * (4 * limit) + '"}').encode()
            small = b'{"model": "m", "prompt": "hello"}'
            paths = ["/v1/chat/completions", "/v1/completions", "/v1/responses",
                     "/v1/embeddings", "/tokenize", "/detokenize"]  # fmt: skip
            for path in paths:
                for data in (big, _chunked(big)):  # declared length, then chunked (none)
                    async with http.post(
                        router.url + path, data=data, headers={"content-type": "application/json"}
                    ) as resp:
                        payload = await resp.json()
                        assert resp.status == 413, (path, resp.status, payload)
                        assert payload["error"]["type"] == "invalid_request_error"
                async with http.post(router.url + path, data=small) as resp:
                    assert resp.status != 413
            assert not [r for r in script.received if len(r.raw) > limit]
            assert router.proc.alive()

    with Loopback() as lb:
        asyncio.run(main(lb))


@pytest.mark.timeout(60)
def test_one_tenants_cache_salt_never_yields_anothers_cache() -> None:
    async def main(lb: Loopback) -> None:
        engines = lb.engines(2, "--speed", "200")
        bridges = lb.bridges(engines)
        router = lb.router(lb.router_config(engines, bridges))
        async with session() as http:
            doc = documents(77, 1, 300)[0]
            a = completion_body(doc, 4, cache_salt="tenant-a-secret")
            status, first, _ = await post_json(http, router.url + "/v1/completions", a)
            assert status == 200
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

            async def a_is_cached() -> bool:
                return (
                    max((v or 0) for v in predictions(await score(http, router.url, a)).values())
                    > 0
                )

            await eventually(a_is_cached, timeout=10)
            # positive control: tenant A itself reuses its cache, predicted and reported
            status, again, headers = await post_json(http, router.url + "/v1/completions", a)
            cached_a = again["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached_a > 0 and int(headers["x-kvroute-predicted-cached-tokens"]) == cached_a
            for other in (
                completion_body(doc, 4, cache_salt="tenant-b"),
                completion_body(doc, 4),  # no salt at all
                completion_body(doc, 4, cache_salt="tenant-a-secreT"),
            ):
                assert all(
                    v in (0, None)
                    for v in predictions(await score(http, router.url, other)).values()
                )
                for e in engines:  # nor would any engine reuse it
                    _, probe, _ = await post_json(http, e.url + "/sim/probe", other)
                    assert probe["cached_tokens"] == 0
                status, got, headers = await post_json(http, router.url + "/v1/completions", other)
                assert status == 200
                assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                assert headers["x-kvroute-predicted-cached-tokens"] == "0"

    with Loopback() as lb:
        asyncio.run(main(lb))
