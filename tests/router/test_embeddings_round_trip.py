"""`/v1/embeddings` through a real `kvroute serve` in front of real pooling `kvroute sim`
engines (`--runner pooling`, a `kvroute bridge` beside each, all on loopback): the answer,
its usage, the router's decision record; with `embeddings_use_cache` the second request with
the same long input goes to the engine whose prefix cache holds it (vLLM's decoder embedders
with last-token pooling read the cache), without it embeddings get no cache evidence."""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from bench.loopback import MODEL, Engine, Loopback, Router, admin_headers
from bench.traffic import eventually, post_json, session, workers
from kvroute.sim.api.embeddings import EMBEDDING_SIZE
from kvroute.sim.model import MODEL_DIR
from kvroute.sim.tokenizer import SimTokenizer
from tests.reliability.workload import documents

pytestmark = pytest.mark.timeout(120)


@dataclass
class PoolingFleet:
    engines: list[Engine]
    cached: Router  # models.<model>.embeddings_use_cache: true
    plain: Router  # the default: embeddings reuse nothing


@pytest.fixture(scope="module")
def fleet() -> Iterator[PoolingFleet]:
    with Loopback() as lb:
        engines = lb.engines(2, "--runner", "pooling", "--speed", "300", "--num-blocks", "2048")
        bridges = lb.bridges(engines)
        use_cache = {MODEL: {"tokenizer": str(MODEL_DIR), "embeddings_use_cache": True}}
        cached = lb.router(lb.router_config(engines, bridges, models=use_cache), "cached")
        plain = lb.router(lb.router_config(engines, bridges), "plain")
        yield PoolingFleet(engines, cached, plain)


async def _embed(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    status, answer, headers = await post_json(http, url + "/v1/embeddings", body)
    assert status == 200, answer
    return headers["x-kvroute-worker"], answer


async def _last_id(http: aiohttp.ClientSession, url: str) -> int:
    status, data, _ = await post_json(
        http, f"{url}/admin/decisions?limit=1", None, admin_headers(), "GET"
    )
    assert status == 200
    return int(data["decisions"][-1]["id"]) if data["decisions"] else 0


async def _decision(http: aiohttp.ClientSession, url: str, after: int) -> dict[str, Any]:
    found: list[dict[str, Any]] = []

    async def recorded() -> bool:
        status, data, _ = await post_json(
            http, f"{url}/admin/decisions?after={after}", None, admin_headers(), "GET"
        )
        assert status == 200
        found[:] = [d for d in data["decisions"] if d["reported_prompt_tokens"] is not None]
        return bool(found)

    await eventually(recorded, timeout=10)
    assert len(found) == 1, found
    return found[0]


async def _predicted(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> dict[str, int | None]:
    """The router's predicted reuse per worker for an embeddings body (/admin/score)."""
    status, scored, _ = await post_json(
        http, f"{url}/admin/score?endpoint=/v1/embeddings", body, admin_headers()
    )
    assert status == 200, scored
    return {w["worker"]: w["predicted_reuse"] for w in scored["workers"]}


async def _live(http: aiohttp.ClientSession, url: str) -> bool:
    ws = await workers(http, url)
    return all(w["healthy"] and w["events"]["state"] == "live" for w in ws.values())


async def _engine_hits(http: aiohttp.ClientSession, fleet: PoolingFleet, ids: list[int]) -> dict:
    """What each engine's own cache holds of these ids (its /sim/probe)."""
    hits = {}
    for e in fleet.engines:
        status, probe, _ = await post_json(
            http, e.url + "/sim/probe", {"model": MODEL, "prompt_token_ids": ids}
        )
        assert status == 200, probe
        hits[e.name] = probe["cached_tokens"]
    return hits


def test_embeddings_round_trip_and_cache_affinity(fleet: PoolingFleet) -> None:
    tok = SimTokenizer(MODEL_DIR)
    url = fleet.cached.url

    async def go() -> None:
        async with session() as http:
            await eventually(lambda: _live(http, url), timeout=20)
            text = documents(seed=500, n=1)[0]
            ids = tok.encode(text, add_special_tokens=True)  # vLLM's default for embeddings
            body = {"model": MODEL, "input": text}

            after = await _last_id(http, url)
            first_worker, answer = await _embed(http, url, body)
            assert answer["object"] == "list" and answer["id"].startswith("embd-")
            (item,) = answer["data"]
            assert item["object"] == "embedding" and len(item["embedding"]) == EMBEDDING_SIZE
            assert answer["usage"]["prompt_tokens"] == len(ids)
            assert answer["usage"]["total_tokens"] == len(ids)
            record = await _decision(http, url, after)
            assert record["endpoint"] == "/v1/embeddings" and record["status"] == 200
            assert record["token_source"] == "local" and record["prompt_tokens"] == len(ids)
            assert record["chosen"] == first_worker
            assert record["reported_prompt_tokens"] == len(ids)

            # the engine that embedded it holds its prefix; the router learns it from events
            hits = await _engine_hits(http, fleet, ids)
            assert hits[first_worker] >= len(ids) - 16
            assert all(v == 0 for name, v in hits.items() if name != first_worker)

            async def known() -> bool:
                return (await _predicted(http, url, body)).get(first_worker) == hits[first_worker]

            await eventually(known, timeout=10)

            after = await _last_id(http, url)
            worker, again = await _embed(http, url, {**body, "encoding_format": "base64"})
            assert worker == first_worker
            raw = base64.b64decode(again["data"][0]["embedding"])
            assert list(struct.unpack(f"<{EMBEDDING_SIZE}f", raw)) == item["embedding"]
            record = await _decision(http, url, after)
            assert record["chosen"] == first_worker and record["reason"] == "cache"
            assert record["predicted_cached_tokens"] == hits[first_worker]

    asyncio.run(go())


def test_without_the_model_flag_embeddings_get_no_cache_evidence(fleet: PoolingFleet) -> None:
    url = fleet.plain.url

    async def go() -> None:
        async with session() as http:
            await eventually(lambda: _live(http, url), timeout=20)
            text = documents(seed=501, n=1)[0]
            body = {"model": MODEL, "input": text}
            await _embed(http, url, body)
            # cached on one engine now, yet no worker is credited with it
            hits = await _engine_hits(http, fleet, SimTokenizer(MODEL_DIR).encode(text))
            assert max(hits.values()) > 0
            await asyncio.sleep(0.5)  # the events have had time to arrive
            assert not any((await _predicted(http, url, body)).values())
            after = await _last_id(http, url)
            await _embed(http, url, body)
            record = await _decision(http, url, after)
            assert record["reason"] != "cache" and record["predicted_cached_tokens"] == 0

    asyncio.run(go())
