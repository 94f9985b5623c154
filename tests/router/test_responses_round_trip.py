"""`/v1/responses` through a real `kvroute serve` in front of real `kvroute sim` engines (with
a `kvroute bridge` beside each, all on loopback): the answer, its usage, the router's decision
record, and a second request with the same long input landing on the worker that holds it,
for string and message-list input, streamed and not."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from bench.loopback import MODEL, Loopback, Router, admin_headers
from bench.traffic import eventually, post_json, score, session, workers
from kvroute.sim.api.responses_request import render_responses
from kvroute.sim.model import MODEL_DIR
from kvroute.sim.tokenizer import SimTokenizer
from tests.reliability.workload import documents

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def router() -> Iterator[Router]:
    with Loopback() as lb:
        engines = lb.engines(2, "--speed", "300", "--num-blocks", "2048")
        bridges = lb.bridges(engines)
        yield lb.router(lb.router_config(engines, bridges))


def _string_body(doc: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "instructions": "Answer from the document.",
        "input": f"{doc}\n\nSummarise the document above.",
        "max_output_tokens": 6,
    }


def _list_body(doc: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": doc}]},
            {"type": "message", "role": "assistant", "content": "Read it."},
            {"role": "user", "content": "Which part matters most?"},
        ],
        "max_output_tokens": 6,
    }


async def _sse(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """(worker, [(event name, data)]) of a streamed Responses request."""
    async with http.post(url + "/v1/responses", json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
        worker = resp.headers["x-kvroute-worker"]
    events = []
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: ")
        events.append((name_line[7:], json.loads(data_line[6:])))
    return worker, events


async def _whole(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    status, answer, headers = await post_json(http, url + "/v1/responses", body)
    assert status == 200, answer
    return headers["x-kvroute-worker"], answer


async def _decision(http: aiohttp.ClientSession, url: str, after: int) -> dict[str, Any]:
    """The one decision the router recorded since id `after` (once the request finished)."""
    found: list[dict[str, Any]] = []

    async def recorded() -> bool:
        status, data, _ = await post_json(
            http, f"{url}/admin/decisions?after={after}", None, admin_headers(), "GET"
        )
        assert status == 200
        found[:] = [d for d in data["decisions"] if d["status"] is not None]
        return bool(found) and found[-1]["reported_prompt_tokens"] is not None

    await eventually(recorded, timeout=10)
    assert len(found) == 1, found
    return found[0]


async def _last_id(http: aiohttp.ClientSession, url: str) -> int:
    status, data, _ = await post_json(
        http, f"{url}/admin/decisions?limit=1", None, admin_headers(), "GET"
    )
    assert status == 200
    return int(data["decisions"][-1]["id"]) if data["decisions"] else 0


def _text_of(answer: dict[str, Any]) -> str:
    (message,) = answer["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    return "".join(part["text"] for part in message["content"])


async def _cached_on(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    """The worker the router predicts holds `body`'s prompt, once its events arrived."""
    holder: list[str] = []

    async def known() -> bool:
        scored = await score(http, url, body)
        holder[:] = [w["worker"] for w in scored["workers"] if (w["predicted_reuse"] or 0) > 0]
        return len(holder) == 1

    await eventually(known, timeout=10)
    return holder[0]


@pytest.mark.parametrize("shape", [_string_body, _list_body], ids=["string", "list"])
def test_responses_round_trip_and_cache_affinity(router: Router, shape: Any) -> None:
    tok = SimTokenizer(MODEL_DIR)
    index = 0 if shape is _string_body else 1

    async def go() -> None:
        async with session() as http:
            await eventually(lambda: _all_live(http, router.url), timeout=20)
            doc = documents(seed=300 + index, n=1)[0]
            body = shape(doc)
            prompt_len = len(render_responses(body, tok)[1])
            assert prompt_len > 200

            # 1. not streamed: the answer, its usage, the decision record
            after = await _last_id(http, router.url)
            first_worker, answer = await _whole(http, router.url, body)
            assert answer["object"] == "response" and answer["id"].startswith("resp_")
            assert answer["model"] == MODEL
            assert answer["status"] == "incomplete"  # 6 tokens asked, the sim runs on
            assert answer["incomplete_details"] == {"reason": "max_output_tokens"}
            assert _text_of(answer).strip()
            usage = answer["usage"]
            assert usage["input_tokens"] == prompt_len
            assert usage["output_tokens"] == 6
            assert usage["total_tokens"] == prompt_len + 6
            assert usage["input_tokens_details"]["cached_tokens"] == 0
            record = await _decision(http, router.url, after)
            assert record["endpoint"] == "/v1/responses"
            assert record["upstream_endpoint"] == "/v1/responses"
            assert record["token_source"] == "local"  # the router tokenized it exactly
            assert record["prompt_tokens"] == prompt_len
            assert record["chosen"] == first_worker and record["status"] == 200
            assert record["reported_prompt_tokens"] == prompt_len
            assert record["reported_cached_tokens"] == 0

            assert await _cached_on(http, router.url, body) == first_worker

            # 2. streamed, same input: the worker that holds it, and it reuses the prefix
            after = await _last_id(http, router.url)
            worker, events = await _sse(http, router.url, body)
            assert worker == first_worker
            names = [name for name, _ in events]
            assert names[:2] == ["response.created", "response.in_progress"]
            assert names[-1] == "response.incomplete"
            assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
            assert all(name == d["type"] for name, d in events)
            deltas = [d["delta"] for name, d in events if name == "response.output_text.delta"]
            final = events[-1][1]["response"]
            assert "".join(deltas) == _text_of(final) and deltas
            stream_usage = final["usage"]
            assert stream_usage["input_tokens"] == prompt_len
            assert stream_usage["output_tokens"] == 6
            cached = stream_usage["input_tokens_details"]["cached_tokens"]
            assert cached >= prompt_len - 16  # everything but the last partial block
            record = await _decision(http, router.url, after)
            assert record["chosen"] == first_worker and record["reason"] == "cache"
            assert record["predicted_cached_tokens"] == cached
            assert record["reported_cached_tokens"] == cached
            others = [c for c in record["candidates"] if c["worker"] != first_worker]
            assert others and all(not c["predicted_reuse"] for c in others)

    asyncio.run(go())


async def _all_live(http: aiohttp.ClientSession, url: str) -> bool:
    ws = await workers(http, url)
    return all(w["healthy"] and w["events"]["state"] == "live" for w in ws.values())
