"""Routing decisions from the real index, fed through the bridge's gRPC service on loopback:
hybrid-correct choice (where a full-attention-only router picks wrongly), cache_salt and LoRA
namespaces, expectations for back-to-back requests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from kvroute.proto import events_pb2
from kvroute.proto.namespace import salt_namespace
from kvroute.router.routing.fleet_index_view import FleetIndexView
from tests.router.harness import Rig, rig
from tests.router.test_events import FakeBridge, until

OP = events_pb2.KvGroupEvent
PROMPT = list(range(5000, 5000 + 1100))  # the request: 1100 token ids
WINDOW = 128


def store(group: int, kind: str, n_blocks: int, *, window: int = 0, salt: str = "",
          lora: str = "", tag: int = 0) -> Any:  # fmt: skip
    """A dense store of the first n_blocks 16-token blocks of PROMPT in one group."""
    return OP(
        operation=OP.STORE,
        group_id=group,
        block_hashes=[(tag << 32 | group << 24 | i).to_bytes(8, "big") for i in range(n_blocks)],
        token_ids=PROMPT[: 16 * n_blocks],
        block_size=16,
        kind=kind,
        sliding_window=window,
        cache_namespace=salt_namespace(salt),
        lora_name=lora,
    )


@contextlib.asynccontextmanager
async def fleet(
    views: dict[str, list[Any]],
    policy: str | dict[str, Any] = "ttft",
    models: list[dict[str, Any]] | None = None,
) -> AsyncIterator[Rig]:
    """Fake engines w0..wn, each with a bridge whose cache holds `views[name]`."""
    bridges = {name: FakeBridge() for name in views}
    for name, bridge in bridges.items():
        await bridge.start()
        bridge.stream.apply(events_pb2.KvEventBatch(sequence=1, events=views[name]))
    try:
        async with rig(
            len(views),
            bridges={n: f"127.0.0.1:{b.port}" for n, b in bridges.items()},
            index=FleetIndexView(16),
            policy=policy,
            models={"m": {"tokenizer": "request"}},
        ) as r:
            if models is not None:
                for s in r.engines.values():
                    s.models = models
                from kvroute.router.fleet.health import ModelsProbe

                for w in r.parts.registry:
                    await ModelsProbe(r.parts.registry, r.parts.upstream)(w)
            await until(lambda: not r.parts.events.unusable())
            yield r
    finally:
        for bridge in bridges.values():
            await bridge.stop()


async def score(r: Rig, **body: Any) -> dict[str, Any]:
    req = {"model": "m", "prompt": PROMPT, **body}
    resp = await r.client.post(
        "/admin/score?endpoint=/v1/completions", json=req, headers=r.admin_headers()
    )
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


HYBRID = {
    # w0: full attention covers 1024 tokens, but its sliding-window group kept only the first
    # 8 blocks: vLLM can reuse just 128 tokens there.
    "w0": [store(0, "full_attention", 64), store(1, "sliding_window", 8, window=WINDOW)],
    # w1: full attention covers 768 tokens and the window group covers them too: 768 reusable
    # (more than w0's 128 plus the default junction credit, half of w0's other 896 tokens).
    "w1": [store(0, "full_attention", 48), store(1, "sliding_window", 48, window=WINDOW)],
}


def test_hybrid_correct_choice_where_full_attention_only_is_wrong() -> None:
    async def go() -> None:
        async with fleet(HYBRID) as r:
            ans = await score(r)
            by = {w["worker"]: w for w in ans["workers"]}
            assert by["w0"]["predicted_reuse"] == 128
            assert by["w1"]["predicted_reuse"] == 768
            assert by["w0"]["full_attention_only_reuse"] == 1024  # what llm-d/Dynamo see
            assert ans["chosen"] == "w1" and ans["reason"] == "cache"
            kinds = {g["kind"]: g["accepted_tokens"] for g in by["w0"]["groups"]}
            assert kinds == {"full_attention": 1024, "sliding_window": 128}
            # the same request through the proxy lands on w1
            resp = await r.client.post("/v1/completions", json={"model": "m", "prompt": PROMPT})
            assert resp.json()["engine"] == "w1"
        async with fleet(HYBRID, policy="full_attention_only") as r:
            ans = await score(r)
            assert ans["chosen"] == "w0"  # the full-attention-only view picks wrongly
            by = {w["worker"]: w for w in ans["workers"]}
            assert by["w0"]["predicted_reuse"] == 1024

    asyncio.run(go())


def test_cache_salt_and_lora_are_separate_namespaces() -> None:
    views = {
        "w0": [store(0, "full_attention", 32, salt="tenant-a", tag=1)],
        "w1": [store(0, "full_attention", 32, tag=2)],
        "w2": [store(0, "full_attention", 48, lora="sql-lora", tag=3)],
    }
    models = [{"id": "m", "object": "model"}, {"id": "sql-lora", "object": "model", "parent": "m"}]

    async def go() -> None:
        async with fleet(views, models=models) as r:
            plain = {w["worker"]: w["predicted_reuse"] for w in (await score(r))["workers"]}
            assert plain == {"w0": 0, "w1": 512, "w2": 0}
            salted = await score(r, cache_salt="tenant-a")
            assert {w["worker"]: w["predicted_reuse"] for w in salted["workers"]} == {
                "w0": 512, "w1": 0, "w2": 0,
            }  # fmt: skip
            assert salted["chosen"] == "w0"
            other = await score(r, cache_salt="tenant-b")
            assert all(w["predicted_reuse"] == 0 for w in other["workers"])
            lora = await score(r, model="sql-lora")
            assert lora["lora_name"] == "sql-lora" and lora["chosen"] == "w2"
            assert {w["worker"]: w["predicted_reuse"] for w in lora["workers"]}["w2"] == 768

    asyncio.run(go())


def test_prompts_are_remembered_for_the_junction_credit_only_on_hybrid_workers() -> None:
    """Remembering who asked for a prompt costs about 0.04 ms per 8,192 tokens
    (bench/results/index.md); a dense fleet never uses it."""

    async def go() -> None:
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 1, "user": "alice"}
        async with fleet({"w0": [store(0, "full_attention", 8)], "w1": []}) as r:
            assert (await r.client.post("/v1/completions", json=body)).status_code == 200
            assert r.parts.routing.remembered_prompt_keys == 0
        async with fleet(JUNCTION) as r:
            assert (await r.client.post("/v1/completions", json=body)).status_code == 200
            assert r.parts.routing.remembered_prompt_keys == len(PROMPT) // 16
            text = (await r.client.get("/metrics")).text
            assert f"kvroute_prefix_sharing_keys {len(PROMPT) // 16}.0" in text
            assert "kvroute_prefix_sharing_forgotten_total 0.0" in text

    asyncio.run(go())


def test_the_sharing_map_forgets_at_its_bound_and_says_so_in_the_metrics() -> None:
    bound = len(PROMPT) // 16 - 2  # the prompt's first two keys are forgotten

    async def go() -> None:
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 1, "user": "alice"}
        policy = {"name": "ttft", "sharing_max_keys": bound}
        async with fleet(JUNCTION, policy=policy) as r:
            assert (await r.client.post("/v1/completions", json=body)).status_code == 200
            text = (await r.client.get("/metrics")).text
            assert f"kvroute_prefix_sharing_keys {bound}.0" in text
            forgotten = len(PROMPT) // 16 - bound
            assert f"kvroute_prefix_sharing_forgotten_total {forgotten}.0" in text
            # the conversation's next turn, whose first keys are forgotten, is routed
            # (regression: the lookup of its own history raised KeyError)
            again = await r.client.post("/v1/completions", json=body)
            assert again.status_code == 200, again.text

    asyncio.run(go())


def test_a_sharing_bookkeeping_failure_routes_the_request_and_is_counted(
    monkeypatch: Any, caplog: Any
) -> None:
    """Like an index failure: the request is routed without the junction rule's history,
    the error is logged once and counted, never answered as a 500."""
    from kvroute.router.routing.prefix_sharing import PrefixSharing

    def broken(*a: Any, **k: Any) -> Any:
        raise RuntimeError("sharing bug")

    monkeypatch.setattr(PrefixSharing, "note", broken)
    monkeypatch.setattr(PrefixSharing, "own_from", broken)

    async def go() -> None:
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 1, "user": "alice"}
        async with fleet(JUNCTION) as r:
            for _ in range(3):
                resp = await r.client.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
            text = (await r.client.get("/metrics")).text
            # own_from and note each failed on every request
            assert 'kvroute_errors_total{kind="sharing"} 6.0' in text

    with caplog.at_level("ERROR"):
        asyncio.run(go())
    logged = [r for r in caplog.records if "prefix sharing bookkeeping failed" in r.getMessage()]
    assert len(logged) == 1


def test_expectation_sends_a_follow_up_to_the_same_worker() -> None:
    async def go() -> None:
        async with fleet({"w0": [], "w1": [], "w2": []}) as r:
            first = await r.client.post("/v1/completions", json={"model": "m", "prompt": PROMPT})
            target = first.json()["engine"]
            # no event has arrived for it, but the router expects the prompt to be cached there
            follow = PROMPT + list(range(100))
            ans = await score(r, prompt=follow)
            assert ans["chosen"] == target and ans["reason"] == "cache"
            by = {w["worker"]: w["predicted_reuse"] for w in ans["workers"]}
            assert by[target] == 1088  # aligned down to 16
            second = await r.client.post("/v1/completions", json={"model": "m", "prompt": follow})
            assert second.json()["engine"] == target

    asyncio.run(go())


JUNCTION = {
    # w0: full attention holds 1024 tokens, the window group only the first 8 blocks: 128
    # reusable now, but serving the request there makes vLLM save window state at 1024.
    "w0": [store(0, "full_attention", 64), store(1, "sliding_window", 8, window=WINDOW)],
    # w1: 512 reusable and nothing more.
    "w1": [store(0, "full_attention", 32), store(1, "sliding_window", 32, window=WINDOW)],
}


def test_junction_credit_invests_where_full_attention_holds_more() -> None:
    async def go() -> None:
        # no expectations: the request sent below must not change what the index predicts
        async with fleet(JUNCTION, policy={"name": "ttft", "expect_seconds": 0}) as r:
            ans = await score(r)
            by = {w["worker"]: w for w in ans["workers"]}
            assert (by["w0"]["predicted_reuse"], by["w1"]["predicted_reuse"]) == (128, 512)
            # w0's junction at 1024 would make 512 tokens beyond w1's reuse reusable:
            # 128 + 1.5 * 512 credited tokens beat 512
            assert ans["chosen"] == "w0" and ans["reason"] == "affinity", ans
            assert by["w0"]["affinity_tokens"] == 1024 - 512
            assert by["w1"]["affinity_tokens"] == 0
            # a conversation asks for it; asking again, the prompt is its own history
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 1, "user": "alice"}
            sent = await r.client.post("/v1/completions", json=body)
            assert sent.status_code == 200, sent.text
            ans = await score(r, user="alice")
            assert ans["chosen"] == "w1" and ans["reason"] == "cache", ans
            assert all(w["affinity_tokens"] == 0 for w in ans["workers"])
            # for any other conversation it is a prefix another one asked for
            ans = await score(r, user="bob")
            assert ans["chosen"] == "w0" and ans["reason"] == "affinity", ans

    asyncio.run(go())
