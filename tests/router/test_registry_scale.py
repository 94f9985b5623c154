"""The worker registry at thousands of workers: a change costs the models it touches, not a
pass over the fleet, and the answers equal a rebuild from scratch after every change."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.config import BreakerConfig, WorkerSpec
from kvroute.router.fleet.workers import ModelRoute, RegistryFull, Worker, WorkerRegistry

MODELS = ["base-a", "base-b", "lora-x"]


def _cards(models: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for m in models:
        out[m] = {"id": m, "parent": "base-a"} if m.startswith("lora") else {"id": m}
    return out


def _rebuilt(reg: WorkerRegistry) -> tuple[dict[str, list[str]], dict[str, ModelRoute]]:
    """What serving() and route() must answer: a pass over the fleet in registry order."""
    by_model: dict[str, list[str]] = {}
    routes: dict[str, ModelRoute] = {}
    for w in reg:
        for name in sorted(w.serves()):
            by_model.setdefault(name, []).append(w.name)
            parent = w.model_cards.get(name, {}).get("parent")
            if isinstance(parent, str) and parent != name:
                routes.setdefault(name, ModelRoute(name, parent, name))
            else:
                routes.setdefault(name, ModelRoute(name, name, ""))
    return by_model, routes


_op = st.tuples(
    st.sampled_from(["add", "remove", "models", "spec_model", "ask"]),
    st.integers(0, 7),  # worker
    st.lists(st.sampled_from(MODELS), max_size=3, unique=True),
    st.integers(0, 2),  # URL (DP ranks share one)
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(_op, max_size=60))
def test_serving_routes_and_shared_urls_equal_a_rebuild(
    ops: list[tuple[str, int, list[str], int]],
) -> None:
    reg = WorkerRegistry(BreakerConfig())
    for op, i, models, url in ops:
        name = f"w{i}"
        w = reg.get(name)
        if op == "add" and w is None:
            reg.add(WorkerSpec(name=name, url=f"http://127.0.0.1:{9000 + url}/"))
        elif op == "remove":
            reg.remove(name)
        elif op == "models" and w is not None:
            reg.set_models(w, _cards(models))
        elif op == "spec_model" and w is not None:
            reg.upsert(WorkerSpec(name=name, url=w.spec.url, model=models[0] if models else ""))
        else:
            for m in MODELS:  # ask between changes, so cached answers must follow them
                reg.serving(m)
                reg.route(m)
        by_model, routes = _rebuilt(reg)
        for m in MODELS:
            assert [x.name for x in reg.serving(m)] == by_model.get(m, [])
            assert reg.route(m) == routes.get(m)
        urls = [x.url for x in reg]
        for x in reg:
            assert x.url_shared == (urls.count(x.url) > 1)


def test_a_fleet_of_thousands_starts_in_work_linear_in_its_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """4,096 workers join, then report their models one by one, with a request resolved
    after each change (what a start-up under traffic does): the registry touches each worker
    a bounded number of times, where a rebuild per change touched the whole fleet each time."""
    n = 4096
    calls = {"serves": 0, "url": 0}
    serves, url = Worker.serves, Worker.url

    def counted_serves(self: Worker) -> set[str]:
        calls["serves"] += 1
        return serves(self)

    def counted_url(self: Worker) -> str:
        calls["url"] += 1
        return url.fget(self)  # type: ignore[attr-defined,no-any-return]

    monkeypatch.setattr(Worker, "serves", counted_serves)
    monkeypatch.setattr(Worker, "url", property(counted_url))
    reg = WorkerRegistry(BreakerConfig(), max_workers=n)
    rng = random.Random(5)
    workers = [
        reg.add(WorkerSpec(name=f"w{i}", url=f"http://10.0.{i // 250}.{i % 250}:8000"))
        for i in range(n)
    ]
    rng.shuffle(workers)  # models arrive in any order
    for w in workers:
        reg.set_models(w, _cards(["base-a"]))
        route = reg.route("base-a")
        assert route is not None and route.base == "base-a"
        assert reg.serving("base-a")
    assert len(reg.serving("base-a")) == n
    assert [w.name for w in reg.serving("base-a")] == [f"w{i}" for i in range(n)]
    assert calls["serves"] < 8 * n
    assert calls["url"] < 8 * n
    with pytest.raises(RegistryFull):  # the bound holds: one more is refused, nothing lost
        reg.add(WorkerSpec(name="extra", url="http://10.9.9.9:8000"))
    assert len(reg) == n and reg.get("extra") is None
