"""A chat answer is encoded into the prefix cache for the next turn (tokenizer.remember_answers).

Unit: the answer's text is taken from whole responses and streams, only when plain. End to
end through a real router and simulated engine on loopback: after an answer, the next turn
encodes only its own new message (measured by the tokenizer's own counters), its ids stay
exact (the engine's prompt length), and the option can be turned off.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from kvroute.router.edge.chat_answer import MAX_ANSWER_BYTES, AnswerTap, answer_of_response
from kvroute.sim.model import MODEL_DIR
from tests.router.sim_fleet import MODEL, SimRig, sim_fleet


def _sse(*objs: Any) -> bytes:
    return (
        b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs) + b"data: [DONE]\n\n"
    )


def _chunk(delta: dict[str, Any], index: int = 0) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": index, "delta": delta}]}


def _tapped(data: bytes, split: int = 7) -> str | None:
    tap = AnswerTap()
    for i in range(0, len(data), split):  # events split anywhere, as reads arrive
        tap.feed(data[i : i + split])
    return tap.answer()


def test_a_streamed_answer_is_its_content_deltas_joined() -> None:
    data = _sse(
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "Hello"}),
        _chunk({"content": ", world"}),
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 3}},
    )
    assert _tapped(data) == "Hello, world"


@pytest.mark.parametrize(
    "events",
    [
        [_chunk({"content": "a"}), _chunk({"tool_calls": [{"index": 0}]})],
        [_chunk({"content": "a"}), _chunk({"content": "b"}, index=1)],  # n > 1
        [_chunk({"content": "a"}), {"error": {"message": "upstream failed"}}],
        [_chunk({"role": "assistant"})],  # no content at all
    ],
)
def test_a_streamed_answer_that_is_not_plain_text_is_not_taken(events: list[Any]) -> None:
    assert _tapped(_sse(*events)) is None


def test_a_stream_past_the_bound_is_dropped() -> None:
    tap = AnswerTap()
    tap.feed(_sse(_chunk({"content": "x" * (MAX_ANSWER_BYTES // 2)})))
    tap.feed(_sse(_chunk({"content": "y" * (MAX_ANSWER_BYTES // 2)})))
    assert tap.answer() is None


def test_a_broken_event_drops_the_answer() -> None:
    assert _tapped(b'data: {"choices": [\n\n') is None


def test_a_whole_answer() -> None:
    def body(*choices: Any) -> bytes:
        return json.dumps({"object": "chat.completion", "choices": list(choices)}).encode()

    msg = {"role": "assistant", "content": "Blue."}
    assert answer_of_response(body({"index": 0, "message": msg})) == "Blue."
    tool = {**msg, "tool_calls": [{"id": "c", "type": "function"}]}
    assert answer_of_response(body({"index": 0, "message": tool})) is None
    two = ({"index": 0, "message": msg}, {"index": 1, "message": msg})
    assert answer_of_response(body(*two)) is None
    assert answer_of_response(body({"index": 0, "message": {**msg, "content": None}})) is None
    assert answer_of_response(b"not json") is None
    assert answer_of_response(b'{"error": {"message": "no"}}') is None


# ---- end to end --------------------------------------------------------------------------


async def _counter(r: SimRig, name: str, **labels: str) -> float:
    """A sample of the router's /metrics page (0 when absent)."""
    text = (await r.client.get("/metrics")).text
    want = {"model": MODEL, **labels}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == want:
                return float(sample.value)
    return 0.0


def _next_user(turn: int) -> str:
    return f"And then what, part {turn}? " * 8


async def _turns(r: SimRig, stream: bool) -> list[tuple[float, int]]:
    """Three turns of one conversation; per turn: (tokens the tokenizer encoded for it, the
    engine's prompt tokens)."""
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You answer at length. " * 30},
        {"role": "user", "content": "Tell me about the sea. " * 10},
    ]
    out: list[tuple[float, int]] = []
    for turn in range(3):
        before = await _counter(r, "kvroute_tokenize_prompt_tokens_total", kind="encoded")
        body = {"model": MODEL, "messages": messages, "max_tokens": 60, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
            async with r.client.stream("POST", "/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200
                raw = b"".join([part async for part in resp.aiter_bytes()])
            chunks = [
                json.loads(line[5:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")
            ]
            answer = "".join(
                c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]
            )
            prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
        else:
            resp = await r.client.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            answer = resp.json()["choices"][0]["message"]["content"]
            prompt_tokens = resp.json()["usage"]["prompt_tokens"]
        encoded = await _counter(r, "kvroute_tokenize_prompt_tokens_total", kind="encoded") - before
        out.append((encoded, prompt_tokens))
        assert answer
        messages = [
            *messages,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": _next_user(turn)},
        ]
        if r.parts.config.tokenizer.remember_answers:
            done = turn + 1
            for _ in range(200):  # the answer is encoded in the background
                if await _counter(r, "kvroute_tokenize_answers_total", result="remembered") >= done:
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the answer was not remembered")
    return out


@pytest.mark.parametrize("stream", [True, False])
def test_end_to_end_the_next_turn_encodes_only_its_new_message(stream: bool) -> None:
    """With answers remembered, each later turn encodes its new user message and the
    template's markers around it; without, the answer (~60 tokens) as well. The
    engine counts the same prompt tokens either way (the ids are exact)."""

    async def run(remember: bool) -> list[tuple[float, int]]:
        router = {
            "models": {MODEL: {"tokenizer": str(MODEL_DIR), "send_token_ids": True}},
            "tokenizer": {"remember_answers": remember},
        }
        async with sim_fleet(1, router=router) as r:
            got = await _turns(r, stream)
            answers = await _counter(r, "kvroute_tokenize_prompt_tokens_total", kind="answer")
            assert (answers > 0) == remember
            return got

    async def go() -> None:
        on, off = await run(True), await run(False)
        assert [p for _, p in on] == [p for _, p in off]  # same prompts, same lengths
        assert on[0][0] == off[0][0]  # the first turn has no answer before it
        tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
        for turn, ((enc_on, _), (enc_off, _)) in enumerate(zip(on[1:], off[1:], strict=True)):
            new = tok.encode(_next_user(turn), add_special_tokens=False).ids
            # the new message plus the template's markers around it, and nothing else
            assert len(new) < enc_on <= len(new) + 16, (turn, on)
            assert enc_on + 40 <= enc_off, (on, off)  # the ~60-token answer is not encoded

    asyncio.run(go())
