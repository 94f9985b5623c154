"""A small fleet of real processes on loopback, shared by the tests of one module: two simulated
engines, a bridge beside each, one router. Each test leaves it whole again (`heal`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from bench.loopback import Bridge, Engine, Loopback, Router
from bench.traffic import completion_body, eventually, post_json, predictions, score, workers

ENGINE_ARGS = ("--speed", "200", "--max-num-seqs", "512")


@dataclass
class Fleet:
    lb: Loopback
    engines: list[Engine]
    bridges: list[Bridge]
    router: Router

    def engine(self, name: str) -> Engine:
        return next(e for e in self.engines if e.name == name)

    def bridge(self, name: str) -> Bridge:
        return next(b for b in self.bridges if b.engine.name == name)


def start_fleet(lb: Loopback, **router_sections: Any) -> Fleet:
    engines = lb.engines(2, *ENGINE_ARGS)
    bridges = lb.bridges(engines)
    sections: dict[str, Any] = {"breaker": {"open_s": 0.5, "failure_threshold": 3}}
    sections.update(router_sections)
    router = lb.router(lb.router_config(engines, bridges, **sections))
    return Fleet(lb, engines, bridges, router)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with Loopback() as lb:
        f = start_fleet(lb)
        yield f


async def heal(http: aiohttp.ClientSession, f: Fleet) -> None:
    """Restart whatever died, clear every fault, and wait until the router sees every worker
    healthy with a live event stream."""
    for e in f.engines:
        if not e.proc.alive():
            f.lb.restart_engine(e)
        else:
            e.proc.resume()
            await post_json(
                http,
                e.url + "/sim/faults",
                {"fail_next": 0, "fail_rate": 0.0, "slowdown": 1.0, "hang": False, "replay": True},
            )
    for b in f.bridges:
        if not b.proc.alive():
            f.lb.restart_bridge(b)
    if not f.router.proc.alive():
        f.lb.restart_router(f.router)
    f.router.proc.resume()

    async def whole() -> bool:
        ws = await workers(http, f.router.url)
        return all(w["healthy"] and w["events"]["state"] == "live" for w in ws.values())

    await eventually(whole, timeout=20)


async def exact(
    http: aiohttp.ClientSession, f: Fleet, bodies: list[dict[str, Any]], router: str = ""
) -> bool:
    """The router's predictions equal every engine's own answer (/sim/probe) for `bodies`."""
    for body in bodies:
        predicted = predictions(await score(http, router or f.router.url, body))
        for e in f.engines:
            _, truth, _ = await post_json(http, e.url + "/sim/probe", body)
            got, want = predicted.get(e.name), truth["cached_tokens"]
            if got != want and not (got is None and want == 0):
                print(f"not exact: {e.name} predicted {got}, engine has {want}")  # for failures
                return False
    return True


async def never_over(http: aiohttp.ClientSession, f: Fleet, bodies: list[dict[str, Any]]) -> None:
    """No prediction exceeds what the engine would actually reuse (no stale hits)."""
    for body in bodies:
        predicted = predictions(await score(http, f.router.url, body))
        for e in f.engines:
            _, truth, _ = await post_json(http, e.url + "/sim/probe", body)
            assert (predicted.get(e.name) or 0) <= truth["cached_tokens"], (e.name, body)


async def cache_on(
    http: aiohttp.ClientSession, engine: Engine, prompts: list[str]
) -> list[dict[str, Any]]:
    """Put `prompts` in one engine's cache by asking it directly (its events still flow to
    the bridge and the router); returns the bodies, for probing."""
    bodies = [completion_body(p, max_tokens=1) for p in prompts]
    answers = await asyncio.gather(
        *(post_json(http, engine.url + "/v1/completions", b) for b in bodies)
    )
    assert all(status == 200 for status, _, _ in answers)
    return bodies
