"""The pieces of prefill/decode routing without processes: the decode worker's price and the
two request bodies (end to end: test_pd_integration.py)."""

from __future__ import annotations

import json

import pytest

from kvroute.router.config import PdConfig, PolicyConfig
from kvroute.router.edge.pd_wire import (
    HandoffError,
    decode_body,
    handoff_params,
    prefill_body,
    splittable,
)
from kvroute.router.fleet.load import EngineMetrics, LoadTicket
from kvroute.router.routing.decode_choice import choose_decode
from kvroute.router.routing.link_rate import LinkRate
from kvroute.router.routing.policy import LoadModel
from tests.router.decode_workers import decoders

PD = PdConfig(link_gbps=8.0, kv_bytes_per_token=1000, running_s=0.01)  # 1 us per token


def load_model() -> LoadModel:
    return LoadModel(PolicyConfig(), lambda: 1000.0, stale_after_s=5.0)


def test_decode_worker_holding_the_prompt_pulls_less_and_wins() -> None:
    ws = decoders(3)
    choice = choose_decode(ws, {"d0": 0, "d1": 3000, "d2": None}, 4000, load_model(), PD, 0.0)
    assert choice.chosen is not None and choice.chosen.name == "d1"
    by = {c.name: c for c in choice.candidates}
    assert by["d1"].uncached == 1000 and by["d0"].uncached == 4000 == by["d2"].uncached
    assert by["d1"].terms["transfer"] == pytest.approx(1000 * 1000 * 8 / 8e9)
    assert by["d1"].cost_s < by["d0"].cost_s


def test_decode_load_outweighs_a_small_saving() -> None:
    ws = decoders(2)
    for _ in range(5):
        LoadTicket(ws[1].load, 0)  # 5 sequences decoding on d1: 0.05 s
    choice = choose_decode(ws, {"d0": 0, "d1": 2000}, 4000, load_model(), PD, 0.0)
    assert choice.chosen is not None and choice.chosen.name == "d0"  # 4 ms beats 2 + 50 ms
    by = {c.name: c for c in choice.candidates}
    assert by["d1"].terms["decode_load"] == pytest.approx(0.05)


def test_saturated_decode_worker_is_passed_over_while_another_can_take_it() -> None:
    ws = decoders(2)
    ws[0].load.engine = EngineMetrics(1, 0, 0.99, at=0.0, own_running_at=0, own_prefilling_at=0)
    choice = choose_decode(ws, {"d0": 4000, "d1": 0}, 4000, load_model(), PD, 0.0)
    assert choice.chosen is not None and choice.chosen.name == "d1"
    assert choose_decode([], {}, 10, load_model(), PD, 0.0).chosen is None


def test_prefill_body_asks_for_one_token_without_streaming() -> None:
    body = json.dumps({"model": "m", "prompt": "hi", "stream": True, "max_tokens": 300,
                       "stream_options": {"include_usage": True}, "min_tokens": 5,
                       "max_completion_tokens": 200}).encode()  # fmt: skip
    got = json.loads(prefill_body(body))
    assert got == {"model": "m", "prompt": "hi", "stream": False, "max_tokens": 1,
                   "max_completion_tokens": 1,
                   "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip


def test_decode_body_is_the_request_with_the_prefill_params() -> None:
    body = json.dumps({"model": "m", "prompt": "hi", "stream": True, "max_tokens": 9}).encode()
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]]}
    assert json.loads(decode_body(body, params)) == {
        "model": "m", "prompt": "hi", "stream": True, "max_tokens": 9,
        "kv_transfer_params": params,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"[1]", "not a JSON object"),
        (b'{"choices": []}', "no kv_transfer_params"),
        (b'{"kv_transfer_params": null}', "kv_producer"),
        (b'{"kv_transfer_params": {"do_remote_prefill": true}}', "missing remote_engine_id"),
    ],
)
def test_a_prefill_answer_without_usable_params_is_refused(answer: bytes, message: str) -> None:
    with pytest.raises(HandoffError, match=message):
        handoff_params(answer)


def test_handoff_params_takes_the_prefill_params() -> None:
    params = {
        "do_remote_prefill": True, "remote_block_ids": [[4, 5]], "remote_engine_id": "e",
        "remote_request_id": "r", "remote_host": "h", "remote_port": 1,
    }  # fmt: skip
    assert handoff_params(json.dumps({"kv_transfer_params": params}).encode()) == params


def test_link_rate_is_learned_from_large_pulls_only_when_asked() -> None:
    fixed = LinkRate(1e9, learn=False)
    learning = LinkRate(1e9, learn=True)
    for rate in (fixed, learning):
        rate.observe(100, 1000, 0.001)  # a small pull: its time is mostly not the link
        assert rate.learned is None and rate.bytes_per_s() == 1e9
        rate.observe(1000, 1000, 0.01)  # 1e6 bytes in 10 ms: 1e8 B/s
        rate.observe(1000, 1000, 0.0)  # no time: ignored
    assert fixed.bytes_per_s() == 1e9 and fixed.learned == pytest.approx(1e8)
    assert learning.bytes_per_s() == pytest.approx(1e8)
    learning.observe(2000, 1000, 0.01)  # 2e8 B/s, weighted in
    assert 1e8 < learning.bytes_per_s() < 2e8 and learning.samples == 2


def test_decode_transfer_is_priced_at_the_given_link_rate() -> None:
    ws = decoders(1)
    slow = choose_decode(ws, {"d0": 0}, 1000, load_model(), PD, 0.0, link_bytes_per_s=1e6)
    assert slow.chosen is not None
    assert slow.chosen.terms["transfer"] == pytest.approx(1000 * 1000 / 1e6)


@pytest.mark.parametrize(
    ("endpoint", "body", "ok"),
    [
        ("/v1/completions", {"prompt": "one"}, True),
        ("/v1/completions", {"prompt": [1, 2, 3]}, True),
        ("/v1/completions", {"prompt": ["only one"]}, True),
        ("/v1/completions", {"prompt": ["one", "two"]}, False),
        ("/v1/completions", {"prompt": [[1], [2]]}, False),
        ("/v1/chat/completions", {"messages": [], "n": 2}, False),
        ("/v1/chat/completions", {"messages": [], "n": 1}, True),
        ("/v1/embeddings", {"input": "x"}, False),
        ("/v1/responses", {"input": "x"}, False),
    ],
)
def test_only_one_prompt_with_one_choice_is_split(
    endpoint: str, body: dict[str, object], ok: bool
) -> None:
    assert splittable(endpoint, body) is ok


def test_equal_decode_workers_take_turns() -> None:
    ws = decoders(3)
    picks = [choose_decode(ws, {}, 500, load_model(), PD, 0.0, turn=t).chosen for t in range(6)]
    assert [c.name if c else None for c in picks] == ["d0", "d1", "d2", "d0", "d1", "d2"]
    # a worker holding the prompt is not equal: it wins every turn
    for t in range(3):
        held = choose_decode(ws, {"d2": 400}, 500, load_model(), PD, 0.0, turn=t).chosen
        assert held is not None and held.name == "d2"


def test_a_cache_blind_policy_takes_decode_workers_in_turn_whatever_they_hold() -> None:
    ws = decoders(3)
    reuse = {"d2": 400}  # d2 holds the prompt: the priced choice takes it every time
    picks = [
        choose_decode(ws, reuse, 500, load_model(), PD, 0.0, turn=t, in_turn=True) for t in range(6)
    ]
    assert [p.chosen.name if p.chosen else None for p in picks] == ["d0", "d1", "d2"] * 2
    assert all(p.tied == 3 for p in picks)  # so the caller advances the turn
    by = {c.name: c for c in picks[0].candidates}
    assert (by["d0"].uncached, by["d2"].uncached) == (500, 100)  # still what each would pull
    # a saturated worker is still passed over
    ws[0].load.engine = EngineMetrics(1, 0, 0.99, at=0.0, own_running_at=0, own_prefilling_at=0)
    names = {
        c.name
        for t in range(4)
        if (c := choose_decode(ws, {}, 500, load_model(), PD, 0.0, turn=t, in_turn=True).chosen)
    }
    assert names == {"d1", "d2"}
