"""A model with Mamba layers on a prefill/decode fleet, end to end: a real `kvroute serve` in
front of `kvroute sim fleet --profile mamba --prefill 1 --decode 1` (engines with vLLM's P/D
protocol, each with its bridge), on loopback. The prefill engine runs all of the prompt but
its last token (vLLM 0.33's NIXL connector with Mamba layers), the decode engine loads that
and computes the last token; the router's predictions still match what the engines report."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvroute.testbed.procs import ProcessGroup
from tests.router.pd_rig import PdRig, serve_fleet

SYSTEM = "You explain hybrid models, whose Mamba layers carry a state from token to token. " * 8


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdRig]:
    run_dir = tmp_path_factory.mktemp("pd-mamba")
    with ProcessGroup(run_dir) as pg:
        rig = serve_fleet(
            pg, run_dir, "mamba", ["--prefill", "1", "--decode", "1", "--speed", "100"]
        )
        assert sorted(rig.engines) == ["decode-0", "prefill-0"]
        yield rig


def _queries(url: str) -> float:
    """The engine's prefix-cache queries so far: the prompt tokens it ran."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prefix_cache_queries_total")
    )


def _tokens(url: str, messages: list[dict[str, str]], model: str) -> int:
    body = {"model": model, "messages": messages}
    return int(httpx.post(url + "/tokenize", json=body, timeout=5).json()["count"])


def test_a_mamba_conversation_runs_through_both_pools(rig: PdRig) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What does the decode engine compute itself?"},
    ]
    prefill_url, decode_url = rig.engines["prefill-0"], rig.engines["decode-0"]
    for turn in range(4):
        n = _tokens(prefill_url, messages, rig.model)
        leases = rig.state("prefill-0")["kv_transfer"]["leases_granted"]
        ran = _queries(prefill_url)
        body = {"model": rig.model, "messages": messages, "max_tokens": 8, "stream": turn % 2 == 1}
        if turn % 2:
            body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", rig.url + "/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200, r.read()
            text = r.read().decode()
        record = rig.last()
        assert record["status"] == 200
        pd = record["pd"]
        assert [a["worker"] for a in pd["prefill"]] == ["prefill-0"]
        assert [(a["worker"], a["outcome"]) for a in pd["decode"]] == [("decode-0", "200")]
        assert record["reported_prompt_tokens"] == n  # the client sees the whole prompt
        # the prefill engine ran all but the last token of the prompt, for the decode to pull
        assert rig.state("prefill-0")["kv_transfer"]["leases_granted"] == leases + 1
        assert _queries(prefill_url) - ran == n - 1
        # the router's prediction of the prefill engine's hit is what the engine reported
        assert record["outcome"] == "exact", record
        assert text
        messages += [
            {"role": "assistant", "content": f"Answer {turn}."},
            {"role": "user", "content": f"And then, in turn {turn + 1}? " * 3},
        ]
    decode_state = httpx.get(decode_url + "/sim/state", timeout=5).json()["kv_transfer"]
    assert decode_state["pulls"].get("ok", 0) == 4
    # later turns found the conversation's earlier turns cached on the prefill engine
    hits = [d["reported_cached_tokens"] for d in rig.decisions()]
    assert hits[0] == 0 and all(h > 0 for h in hits[1:]), hits
