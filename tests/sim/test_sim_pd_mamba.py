"""Prefill/decode disaggregation of a model with Mamba layers in the simulated engine: the
producer runs all of the prompt but its last token and the consumer computes that one
(kvroute/sim/engine/kv_transfer.py), the split vLLM 0.33's NIXL connector makes. The split
itself is read from vLLM's own scheduler-side code in vLLM's environment."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from vllm_env import run_in_vllm

from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.engine.kv_transfer import TransferConfig
from kvroute.sim.server import SimEngineThread

PROMPT = "A hybrid model carries a recurrent state beside its attention blocks. " * 9


def _engine(role: str, profile: str) -> SimEngineThread:
    cfg = EngineConfig(
        profile=profile,
        speed=50.0,
        num_blocks=1024,
        max_model_len=2048,
        kv_transfer=TransferConfig(role),
    )
    return SimEngineThread(cfg)


@pytest.fixture(scope="module")
def mamba_pair() -> Iterator[tuple[SimEngineThread, SimEngineThread]]:
    with _engine("kv_producer", "mamba") as producer, _engine("kv_consumer", "mamba") as consumer:
        yield producer, consumer


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(url + "/v1/completions", json={"model": "kvroute-sim", **body}, timeout=20)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def _queries(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        if fam.name == "vllm:prefix_cache_queries"
        for s in fam.samples
        if s.name.endswith("_total")
    )


def _prompt_len(url: str) -> int:
    body = {"model": "kvroute-sim", "prompt": PROMPT}
    return int(httpx.post(url + "/tokenize", json=body, timeout=5).json()["count"])


def test_mamba_prefill_stops_one_token_short_and_decode_computes_it(
    mamba_pair: tuple[SimEngineThread, SimEngineThread],
) -> None:
    producer, consumer = mamba_pair
    n = _prompt_len(producer.url)
    before = _queries(producer.url)
    answer = _post(
        producer.url,
        {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    params = answer["kv_transfer_params"]
    # the producer ran n - 1 prompt tokens and hands over exactly those
    assert params["remote_num_tokens"] == n - 1
    assert _queries(producer.url) - before == n - 1
    # the client-facing usage still counts the whole prompt (vLLM's front end keeps its copy)
    assert answer["usage"]["prompt_tokens"] == n

    before = _queries(consumer.url)
    out = _post(consumer.url, {"prompt": PROMPT, "max_tokens": 5, "kv_transfer_params": params})
    assert out["usage"]["completion_tokens"] == 5 and out["usage"]["prompt_tokens"] == n
    state = httpx.get(consumer.url + "/sim/state", timeout=5).json()["kv_transfer"]
    assert state["pulls"] == {"ok": 1} and state["blocks_pulled"] > 0
    assert _queries(consumer.url) - before == n  # the consumer's request is the whole prompt


def test_a_model_without_mamba_is_split_after_the_whole_prompt() -> None:
    with _engine("kv_producer", "swa") as producer:
        n = _prompt_len(producer.url)
        params = _post(
            producer.url,
            {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        )["kv_transfer_params"]
        assert params["remote_num_tokens"] == n


# vLLM's own methods on a stand-in connector: the tokens a producer keeps from a prompt of
# `n`, and the tokens a consumer loads, with and without Mamba layers.
_VLLM_SPLIT = """
import json, sys, types
from types import SimpleNamespace
sys.modules.setdefault("einops", types.ModuleType("einops"))
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
    NixlBaseConnectorScheduler as S,
)
n = int(sys.argv[1])
out = {}
for mamba in (True, False):
    conn = SimpleNamespace(
        _has_mamba=mamba, _bounded_replay=False,
        vllm_config=SimpleNamespace(num_prefill_lookahead_tokens=0),
    )
    conn._prefill_backoff = lambda c=conn: S._prefill_backoff(c)
    req = SimpleNamespace(
        kv_transfer_params={"do_remote_decode": True}, num_prompt_tokens=n,
        prompt_token_ids=list(range(n)), prompt_embeds=None, _all_token_ids=list(range(n)),
        max_tokens=8, get_skip_reading_prefix_cache=lambda: False,
    )
    S._truncate_request_for_prefill(conn, req)
    out["mamba" if mamba else "dense"] = {
        "producer_runs": req.num_prompt_tokens,
        "consumer_loads": S._get_remote_prefill_token_count(conn, n),
    }
print(json.dumps(out))
"""


@pytest.mark.vllm
def test_the_split_is_vllm_nixl_connectors() -> None:
    n = 97
    got = run_in_vllm(["-c", _VLLM_SPLIT, str(n)])
    assert got["mamba"] == {"producer_runs": n - 1, "consumer_loads": n - 1}
    assert got["dense"] == {"producer_runs": n, "consumer_loads": n}
