"""A `/v1/responses` stream opens with `response.created` and `response.in_progress` before
the engine has run the request (vLLM's order, and the simulated engine's): the router takes
the first event past those as the end of the prefill, not the first byte."""

from __future__ import annotations

import asyncio

import pytest

from kvroute.router.edge.prefill_watch import ResponsesPrefillWatch
from kvroute.sim.timing import DEFAULT_GPU, chunk_context
from tests.router.sim_fleet import MODEL, sim_fleet

CREATED = b'event: response.created\ndata: {"type":"response.created"}\n\n'
IN_PROGRESS = b'event: response.in_progress\ndata: {"type":"response.in_progress"}\n\n'
ADDED = b'event: response.output_item.added\ndata: {"type":"response.output_item.added"}\n\n'
COMPLETED = b'event: response.completed\ndata: {"type":"response.completed"}\n\n'


def test_the_watch_fires_once_at_the_first_event_past_the_opening_ones() -> None:
    watch = ResponsesPrefillWatch()
    assert not watch.feed(CREATED + IN_PROGRESS)
    assert watch.feed(ADDED)
    assert watch.done and not watch.feed(COMPLETED)


@pytest.mark.parametrize("cut", range(1, len(CREATED) + len(IN_PROGRESS)))
def test_opening_events_cut_anywhere_do_not_fire_it(cut: int) -> None:
    opening = CREATED + IN_PROGRESS
    watch = ResponsesPrefillWatch()
    assert not watch.feed(opening[:cut])
    assert not watch.feed(opening[cut:])
    assert watch.feed(COMPLETED)  # an answer without text: the terminal event ends it


def test_router_learns_the_prefill_rate_from_responses_streams() -> None:
    """Configured 100x too fast, the router learns the simulated GPU's prefill rate from
    streamed Responses requests, whose first bytes come before the prefill."""
    speed = 1.0

    def modelled_s(n: int) -> float:  # one prefill chunk alone on the modelled GPU
        return DEFAULT_GPU.step_seconds(n, chunk_context(0, n), 0, 0) / speed

    true_rate = (1800 - 200) / (modelled_s(1800) - modelled_s(200))

    async def go() -> float:
        router = {
            "policy": {
                "name": "ttft",
                "prefill_tokens_per_s": 100 * true_rate,
                "learn_prefill_rate": True,
            }
        }
        async with sim_fleet(1, engine={"speed": speed}, router=router) as r:
            for i in range(48):
                words = 200 + (i * 37) % 1600  # distinct prompts, spread sizes, no reuse
                body = {
                    "model": MODEL,
                    "input": f"p{i} " + " ".join(f"t{i}x{k}" for k in range(words // 3)),
                    "max_output_tokens": 1,
                    "stream": True,
                }
                async with r.client.stream("POST", "/v1/responses", json=body) as resp:
                    assert resp.status_code == 200
                    async for _ in resp.aiter_bytes():
                        pass
            text = (await r.client.get("/metrics")).text
        values = {
            x.split()[0]: float(x.split()[-1])
            for x in text.splitlines()
            if x.startswith("kvroute_prefill_tokens_per_second")
        }
        return values["kvroute_prefill_tokens_per_second_measured"]

    learned = asyncio.run(go())
    assert true_rate / 2.5 < learned < true_rate * 2.5, (learned, true_rate)
