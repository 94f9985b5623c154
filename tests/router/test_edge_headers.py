"""Headers a client may not set for the engine: its `x-data-parallel-rank` (the router's own
is sent instead), hop-by-hop headers it names in `Connection:`, and X-Forwarded-* / Forwarded
unless the peer is a configured trusted proxy. Checked on what a real engine received."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from tests.router.fake_engine import EngineScript, make_engine, serve
from tests.router.harness import rig

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
HOSTILE = {
    "x-data-parallel-rank": "7",
    "connection": "keep-alive, x-secret-hop",
    "x-secret-hop": "s",
    "x-forwarded-for": "6.6.6.6",
    "x-forwarded-host": "evil.example",
    "forwarded": "for=6.6.6.6",
    "x-request-id": "r1",
}


def _headers_seen(edge: dict[str, Any] | None = None) -> list[list[tuple[str, str]]]:
    """Two DP ranks behind one engine URL; one chat request each way; the header lists the
    engine received."""

    async def go() -> list[list[tuple[str, str]]]:
        script = EngineScript("e")
        async with contextlib.AsyncExitStack() as stack:
            url = await stack.enter_async_context(serve(make_engine(script)))
            workers = [
                {"name": "r0", "url": url, "dp_rank": 0},
                {"name": "r1", "url": url, "dp_rank": 1},
            ]
            r = await stack.enter_async_context(
                rig(0, extra_workers=workers, **({"edge": edge} if edge else {}))
            )
            for _ in range(4):
                resp = await r.client.post("/v1/chat/completions", json=CHAT, headers=HOSTILE)
                assert resp.status_code == 200
                tok = await r.client.post(
                    "/tokenize", json={"model": "m", "prompt": "x"}, headers=HOSTILE
                )
                assert tok.status_code == 200
            return [got.header_list for got in script.received]

    return asyncio.run(go())


def test_client_rank_hop_by_hop_and_forwarded_headers_do_not_reach_the_engine() -> None:
    seen = _headers_seen()
    assert len(seen) == 4
    for headers in seen:
        names = [k for k, _ in headers]
        ranks = [v for k, v in headers if k == "x-data-parallel-rank"]
        assert ranks in (["0"], ["1"])  # the router's, once; never the client's 7
        assert "x-secret-hop" not in names
        assert not [n for n in names if n.startswith("x-forwarded-") or n == "forwarded"]
        assert ("x-request-id", "r1") in headers  # ordinary headers still pass


def test_forwarded_headers_pass_from_a_trusted_peer() -> None:
    seen = _headers_seen({"trusted_proxies": ["127.0.0.0/8"]})
    for headers in seen:
        assert ("x-forwarded-for", "6.6.6.6") in headers
        assert ("forwarded", "for=6.6.6.6") in headers
        assert [v for k, v in headers if k == "x-data-parallel-rank"] in (["0"], ["1"])
        assert "x-secret-hop" not in [k for k, _ in headers]
