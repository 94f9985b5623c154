"""The bench proxy's session-hash baseline and the oracle's tie rule, in front of real simulated
engines on loopback."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from bench.proxy import make_app, oracle_pick, session_engine
from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.server import SimEngineThread
from kvroute.testbed.procs import free_port
from kvroute.testbed.textgen import TokenSpace

MODEL = "kvroute-sim"


def test_oracle_pick_ties_within_the_share_of_the_prompt_go_to_the_least_loaded() -> None:
    # one shared block held by a busy engine is no reason to queue behind it
    assert oracle_pick([512, 0, 0, 0], [5, 0, 0, 0], 7000, tie_share=0.1) == 1
    assert oracle_pick([512, 0, 0, 0], [5, 0, 0, 0], 7000, tie_share=0.0) == 0
    # a conversation's history is not a tie: it stays where its cache is, however busy
    assert oracle_pick([3000, 600, 600, 600], [5, 0, 0, 0], 3500, tie_share=0.1) == 0
    # equal scores and loads: the lowest index
    assert oracle_pick([16, 16, 16], [1, 1, 1], 100, tie_share=0.0) == 0
    assert oracle_pick([16, 16, 16], [2, 1, 1], 100, tie_share=0.0) == 1


def test_session_engine_is_stable_spread_and_moves_only_a_removed_engines_sessions() -> None:
    keys = [f"chat-{i:04d}" for i in range(400)]
    four = [session_engine(k, 4) for k in keys]
    assert four == [session_engine(k, 4) for k in keys]
    counts = collections.Counter(four)
    assert set(counts) == {0, 1, 2, 3} and min(counts.values()) > 60
    # without engine 3 (the last index), only its sessions move
    three = [session_engine(k, 3) for k in keys]
    assert all(a == b for a, b in zip(four, three, strict=True) if a != 3)


@pytest.fixture()
def engines() -> Iterator[list[SimEngineThread]]:
    # slow engines, so that a request is still in flight when the next one is routed
    with (
        SimEngineThread(EngineConfig(model=MODEL, speed=0.2), name="sim-0") as a,
        SimEngineThread(EngineConfig(model=MODEL, speed=0.2), name="sim-1") as b,
    ):
        yield [a, b]


async def _with_proxy(app: web.Application, body: Any) -> Any:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as http:
            return await body(http, f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


async def _post(
    http: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, session: str | None = None
) -> str:
    headers = {"x-session-id": session} if session else {}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    async with http.post(url + "/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["x-bench-worker"]


def test_session_hash_sends_every_turn_of_a_conversation_to_its_engine(
    engines: list[SimEngineThread],
) -> None:
    space = TokenSpace.discover()
    app = make_app([e.url for e in engines], "session_hash")

    async def body(http: aiohttp.ClientSession, url: str) -> dict[str, set[str]]:
        seen: dict[str, set[str]] = {}
        for turn in range(3):
            for i in range(6):
                key = f"conv-{i}"
                text = space.text((key, turn), 20)
                seen.setdefault(key, set()).add(await _post(http, url, text, 1, key))
        return seen

    seen = asyncio.run(_with_proxy(app, body))
    for key, workers in seen.items():
        assert workers == {str(session_engine(key, 2))}
    assert len(set().union(*seen.values())) == 2


@pytest.mark.parametrize(("tie_share", "expected"), [(0.1, "1"), (0.0, "0")])
def test_oracle_does_not_queue_behind_a_busy_engine_for_one_shared_block(
    engines: list[SimEngineThread], tie_share: float, expected: str
) -> None:
    """Two prompts share 64 tokens and nothing else; the first is still being answered when the
    second is routed. Counting the shared block as an advantage sends the second behind the
    first (tie share 0, the earlier rule); within the tie share it goes to the idle engine."""
    space = TokenSpace.discover()
    shared = space.text(("shared",), 64)
    first = shared + space.text(("first",), 1000)
    second = shared + space.text(("second",), 1000)
    app = make_app([e.url for e in engines], "oracle", tie_share=tie_share)

    async def body(http: aiohttp.ClientSession, url: str) -> tuple[str, str]:
        busy = asyncio.create_task(_post(http, url, first, 200))
        await asyncio.sleep(0.5)  # the first is prefilled and decoding on its engine
        assert not busy.done()
        second_worker = await _post(http, url, second, 1)
        return await busy, second_worker

    first_worker, second_worker = asyncio.run(_with_proxy(app, body))
    assert first_worker == "0"
    assert second_worker == expected
