"""Chat requests sent to the engine as completions of the router's token ids
(`models.NAME.send_token_ids`): which requests qualify, the answer's conversion back to chat
shape, and end to end through simulated engines (real sockets), where the client must get the
answer the engine gives the chat request itself."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import msgspec
import pytest

from kvroute.router.edge.chat_as_completion import ChatStream, chat_response, completion_body
from tests.router.sim_fleet import MODEL, SimRig, send_ids, sent_as_ids, sim_fleet
from tests.sim.test_sim_api import CHAT_MESSAGE

PLAIN = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_completion_tokens": 7,
    "temperature": 0.0,
    "stream": True,
    "stream_options": {"include_usage": True},
    "cache_salt": "tenant-a",
    "n": 1,
}


def test_a_plain_chat_request_becomes_a_completion_of_its_ids() -> None:
    body = json.loads(completion_body(PLAIN, [5, 6, 7]) or b"null")
    assert body == {
        "model": "m",
        "prompt": [5, 6, 7],
        "max_tokens": 7,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": "tenant-a",
    }
    legacy = {**PLAIN, "max_tokens": 3}
    del legacy["max_completion_tokens"]
    assert json.loads(completion_body(legacy, [1]) or b"null")["max_tokens"] == 3


@pytest.mark.parametrize(
    "change",
    [
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"response_format": {"type": "json_object"}},
        {"logprobs": True},
        {"n": 2},
        {"max_completion_tokens": None},  # a completion's default (16) is not a chat's
        {"max_completion_tokens": 0},
        {"max_completion_tokens": True},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"some_future_field": 1},
    ],
)
def test_requests_that_are_not_plain_keep_the_chat_endpoint(change: dict[str, Any]) -> None:
    body = {k: v for k, v in {**PLAIN, **change}.items() if v is not None}
    assert completion_body(body, [1, 2]) is None
    assert completion_body(PLAIN, []) is None


def test_a_whole_completion_answer_in_chat_shape() -> None:
    answer = {
        "id": "cmpl-abc",
        "object": "text_completion",
        "created": 9,
        "model": "m",
        "choices": [{"index": 0, "text": " hello", "finish_reason": "length", "stop_reason": None}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        "system_fingerprint": "sim-1",
    }
    chat = json.loads(chat_response(json.dumps(answer).encode()))
    assert chat["id"] == "chatcmpl-abc" and chat["object"] == "chat.completion"
    assert chat["choices"] == [
        {
            "index": 0,
            # every field of vLLM's chat message, unset but for the text
            "message": {**dict.fromkeys(CHAT_MESSAGE), "role": "assistant", "content": " hello"},
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    ]
    assert chat["usage"] == answer["usage"] and chat["system_fingerprint"] == "sim-1"
    error = b'{"object":"error","message":"bad","code":400}'
    assert chat_response(error) == error and chat_response(b"not json") == b"not json"


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunks(data: bytes) -> list[Any]:
    out = []
    for event in data.split(b"\n\n"):
        if event.startswith(b"data: "):
            payload = event[6:]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def test_a_completion_stream_in_chat_shape() -> None:
    head = {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m"}
    stream = ChatStream()
    first = stream.convert(
        _event({**head, "choices": [{"index": 0, "text": " a", "finish_reason": None}]})
        + _event({**head, "choices": [{"index": 0, "text": " b", "finish_reason": None}]})
    )
    last = stream.convert(
        _event(
            {
                **head,
                "choices": [{"index": 0, "text": "", "finish_reason": "stop", "stop_reason": 7}],
            }
        )
        + _event({**head, "choices": [], "usage": {"prompt_tokens": 2}})
        + b'data: {"error": {"message": "boom"}}\n\n'
        + b"data: [DONE]\n\n"
    )
    role, a, b = _chunks(first)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(
        c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-x" for c in (role, a, b)
    )
    assert [c["choices"][0]["delta"] for c in (a, b)] == [{"content": " a"}, {"content": " b"}]
    end, usage, error, done = _chunks(last)
    assert end["choices"][0] == {
        "index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop", "stop_reason": 7
    }  # fmt: skip
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 2}
    assert error == {"error": {"message": "boom"}} and done == "[DONE]"
    assert stream.convert(b"") == b""
    # a chunk serialized without its unset fields has no `object`: its choices tell
    bare = ChatStream().convert(_event({"id": "cmpl-y", "choices": [{"index": 0, "text": "z"}]}))
    assert [c["object"] for c in _chunks(bare)] == ["chat.completion.chunk"] * 2
    assert chat_response(b'{"error": {"message": "no"}}') == b'{"error": {"message": "no"}}'


async def _direct(r: SimRig, worker: str, body: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient() as c:
        resp = await c.post(r.engines[worker].url + "/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def test_end_to_end_the_client_gets_the_chat_answer_the_engine_would_give() -> None:
    messages = [
        {"role": "system", "content": "You are terse. " * 20},
        {"role": "user", "content": "Name a colour. " * 5},
    ]

    async def go() -> None:
        async with sim_fleet(2, router=send_ids()) as r:
            body = {"model": MODEL, "messages": messages, "max_tokens": 12}
            routed = await r.chat(messages, max_tokens=12)
            direct = await _direct(r, routed["_worker"], body)
            assert routed["object"] == "chat.completion"
            assert routed["id"].startswith("chatcmpl-")
            assert routed["choices"][0]["message"] == direct["choices"][0]["message"]
            assert routed["choices"][0]["finish_reason"] == direct["choices"][0]["finish_reason"]
            assert routed["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
            # the engine had the whole prompt cached from the routed request: same ids
            assert direct["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

            # streamed, without usage asked for: chat chunks, content equal, no usage chunk
            stream_body = {**body, "stream": True}
            async with r.client.stream("POST", "/v1/chat/completions", json=stream_body) as resp:
                assert resp.status_code == 200
                raw = b"".join([part async for part in resp.aiter_bytes()])
            chunks = _chunks(raw)
            assert chunks[-1] == "[DONE]"
            objs = chunks[:-1]
            assert all(c["object"] == "chat.completion.chunk" for c in objs)
            assert objs[0]["choices"][0]["delta"]["role"] == "assistant"
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in objs)
            assert text == direct["choices"][0]["message"]["content"]
            assert objs[-1]["choices"][0]["finish_reason"] == "length"
            assert not any("usage" in c for c in objs)

            # not plain (tools): the chat endpoint, as before
            tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
            await r.chat(messages, max_tokens=4, tools=tools)
            assert sent_as_ids(r) == {"yes": 2.0, "not_plain": 1.0}
            # the decision log (and the dashboard) says where each one went
            resp = await r.client.get("/admin/decisions?limit=10", headers=r.admin())
            sent = [(d["endpoint"], d["upstream_endpoint"]) for d in resp.json()["decisions"]]
            chat, completions = "/v1/chat/completions", "/v1/completions"
            assert sent == [(chat, completions), (chat, completions), (chat, chat)]

    asyncio.run(go())


def test_end_to_end_off_by_default() -> None:
    async def go() -> None:
        async with sim_fleet(1) as r:
            await r.chat([{"role": "user", "content": "hi"}], max_tokens=3)
            assert sent_as_ids(r) == {}

    asyncio.run(go())


def test_the_bodies_sent_upstream_are_valid_completions_for_the_sim() -> None:
    """The converted body passes the simulated engine's own completions checks."""

    async def go() -> None:
        async with sim_fleet(1) as r:
            (running,) = r.engines.values()
            plain = {k: v for k, v in PLAIN.items() if k != "stream_options"}
            body = completion_body({**plain, "model": MODEL, "stream": False}, [11, 12, 13])
            assert body is not None
            async with httpx.AsyncClient() as c:
                resp = await c.post(running.url + "/v1/completions", content=body,
                                    headers={"content-type": "application/json"})  # fmt: skip
            assert resp.status_code == 200, resp.text
            answer = msgspec.json.decode(chat_response(resp.content))
            assert answer["usage"]["prompt_tokens"] == 3
            assert answer["usage"]["completion_tokens"] == 7

    asyncio.run(go())
