"""Every decision lists each cost term's value per candidate, and the terms sum to the
estimate: through a real router on loopback (fake engines, scripted index) and on the
policy directly."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvroute.router.config import POLICY_NAMES, PolicyConfig
from kvroute.router.routing.policy import POLICIES, LoadModel, RouteInput, make_policy
from kvroute.router.routing.terms import LOAD_TERMS, ORDER, TERMS
from tests.router.harness import rig
from tests.router.test_policy import fleet

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "user": "s1"}
N = len(b"<user>hello there<assistant>")  # the fake engine's render: one token per byte


def test_admin_decisions_show_every_term_and_they_sum_to_the_estimate() -> None:
    async def go() -> dict[str, Any]:
        async with rig(3) as r:
            # w1 reuses the most; w0's full attention holds more than anyone reuses (a
            # junction credit)
            r.index.scores = {"w0": 0, "w1": 24, "w2": 4}
            r.index.coverages = {"w0": N - 1}
            w2 = r.parts.registry.get("w2")
            assert w2 is not None
            w2.load.running = 3
            w2.load.queued_prefill_tokens = 400
            resp = await r.client.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == 200
            got = await r.client.get("/admin/decisions", headers=r.admin_headers())
            assert got.status_code == 200
            decisions: list[dict[str, Any]] = got.json()["decisions"]
            assert len(decisions) == 1
            return decisions[0]

    d = asyncio.run(go())
    rate = PolicyConfig().prefill_tokens_per_s
    by = {c["worker"]: c for c in d["candidates"]}
    assert set(by) == {"w0", "w1", "w2"}
    for c in by.values():
        terms = c["terms"]
        assert list(terms) == list(ORDER)
        time_sum = sum(v for k, v in terms.items() if TERMS[k].time)
        assert time_sum == pytest.approx(c["est_ttft_s"], abs=1e-5)
        assert sum(terms.values()) == pytest.approx(c["cost_s"], abs=1e-5)
    # each term is what its parameters make of the candidate's load
    assert by["w0"]["terms"]["prefill"] == pytest.approx(N / rate, abs=1e-6)
    assert by["w2"]["terms"]["queue"] == pytest.approx(0.25 * 400 / rate, abs=1e-6)  # reused
    assert by["w2"]["terms"]["running"] == pytest.approx(3 * 100 / rate, abs=1e-6)
    assert by["w1"]["terms"]["running"] == 0.0  # nothing running there
    assert by["w0"]["affinity_tokens"] == N - 1 - 24
    assert by["w0"]["terms"]["junction"] == pytest.approx(-1.5 * (N - 1 - 24) / rate, abs=1e-6)
    assert by["w0"]["cost_s"] < by["w0"]["est_ttft_s"]
    assert d["chosen"] == "w1" and d["reason"] == "cache"


def test_policies_declare_what_they_need() -> None:
    cfg = PolicyConfig()
    lm = LoadModel(cfg, lambda: 1000.0, 5.0)
    assert set(POLICIES) == set(POLICY_NAMES)  # every configurable name has a class
    needs = {name: make_policy(PolicyConfig(name=name), lm) for name in POLICIES}
    assert {n for n, p in needs.items() if p.needs_reuse} == {"ttft", "full_attention_only"}
    assert needs["full_attention_only"].index_view == "full_attention_only"
    assert {p.index_view for n, p in needs.items() if n != "full_attention_only"} == {"reach"}
    # the credit ranks only where reuse is read; everyone estimates the TTFT
    assert needs["ttft"].terms == ORDER
    assert needs["least_load"].terms == LOAD_TERMS and "junction" not in LOAD_TERMS
    d = needs["least_load"].decide(fleet(2), RouteInput(100, {}, None), 0.0)
    assert all(list(c.terms) == list(LOAD_TERMS) for c in d.candidates)


def test_every_term_names_the_config_keys_that_set_it() -> None:
    keys = {f"policy.{k}" for k in PolicyConfig.__dataclass_fields__}
    for name, term in TERMS.items():
        assert term.name == name and term.config
        assert set(term.config) <= keys, name


@pytest.mark.parametrize("name", ["ttft", "session"])
def test_a_removed_worker_leaves_the_policys_session_ring(name: str) -> None:
    """The router tells the policy (`Policy.forget_worker`) instead of looking for a ring."""

    async def go() -> None:
        async with rig(2, policy={"name": name}) as r:
            for user in ("a", "b", "c", "d"):  # cold requests: the session hash places them
                resp = await r.client.post("/v1/chat/completions", json={**CHAT, "user": user})
                assert resp.status_code == 200
            ring = r.parts.policy.session._ring  # type: ignore[attr-defined]
            assert "w0" in ring and "w1" in ring
            h = r.admin_headers()
            gone = await r.client.delete("/admin/workers/w0?drain=false", headers=h)
            assert gone.json()["removed"] is True
            assert "w0" not in ring and "w1" in ring

    asyncio.run(go())


def test_a_term_set_sums_time_terms_before_credits() -> None:
    lm = LoadModel(PolicyConfig(), lambda: 1000.0, 5.0)
    assert lm.terms(ORDER).n_time == len(LOAD_TERMS)
    with pytest.raises(ValueError, match="before credits"):
        lm.terms(("junction", "queue"))
    with pytest.raises(ValueError, match="at least one time term"):
        lm.terms(("junction",))
    with pytest.raises(KeyError):
        lm.terms(("queue", "no_such_term"))
