"""Text completions sent to the engine with the router's token ids as the prompt
(`models.NAME.send_token_ids`): which requests qualify, that nothing else in the body changes,
and end to end through simulated engines (real sockets), where the client must get the answer
the engine gives the text prompt itself."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.router.edge.completion_as_ids import NEEDS_TEXT, completion_ids_body
from tests.router.sim_fleet import MODEL, send_ids, sent_as_ids, sim_fleet

COMPLETIONS = "/v1/completions"
PLAIN = {
    "model": "m",
    "prompt": "Once upon a time",
    "max_tokens": 7,
    "temperature": 0.0,
    "stream": True,
    "stream_options": {"include_usage": True},
    "cache_salt": "tenant-a",
    "logprobs": 2,
    "n": 2,
    "echo": False,
    "add_special_tokens": True,
}


def test_a_text_completion_keeps_every_field_but_its_prompt() -> None:
    body = completion_ids_body(dict(PLAIN), [1, 50, 51, 52])
    assert body is not None
    sent = json.loads(body)
    assert sent["prompt"] == [1, 50, 51, 52]
    # applied when the router encoded the text; vLLM reads it for text prompts only
    assert "add_special_tokens" not in sent
    rest = {k: v for k, v in PLAIN.items() if k not in ("prompt", "add_special_tokens")}
    assert {k: v for k, v in sent.items() if k != "prompt"} == rest


@pytest.mark.parametrize(
    "change",
    [
        {"echo": True},
        {"suffix": " and then"},
        {"truncate_prompt_tokens": 3},
        {"truncation_side": "left"},
        {"return_token_offsets": True},
        {"prompt": ["one", "two"]},  # a batch
        {"prompt": [1, 2, 3]},  # already ids: sent as the client wrote them
        {"prompt_embeds": "AAAA"},
        {"truncate_prompt_tokens": 0},
    ],
)
def test_requests_whose_fields_need_the_text_keep_it(change: dict[str, Any]) -> None:
    assert completion_ids_body({**PLAIN, **change}, [1, 2, 3]) is None


def test_no_ids_no_conversion() -> None:
    assert completion_ids_body(dict(PLAIN), []) is None


_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)


@given(
    extra=st.dictionaries(
        # the fields the rules name, and any other
        st.sampled_from([*NEEDS_TEXT, "add_special_tokens"])
        | st.text(min_size=1, max_size=12).filter(lambda k: k != "prompt"),
        _VALUES,
        max_size=6,
    ),
    ids=st.lists(st.integers(0, 2**31), min_size=1, max_size=50),
)
def test_conversion_changes_the_prompt_and_nothing_else(
    extra: dict[str, Any], ids: list[int]
) -> None:
    body = {**extra, "prompt": "text"}
    got = completion_ids_body(body, ids)
    if any(body.get(k) is not None and body.get(k) is not False for k in NEEDS_TEXT):
        assert got is None
        return
    assert got is not None
    sent = msgspec.json.decode(got)
    assert sent.pop("prompt") == ids
    assert sent == {k: v for k, v in extra.items() if k != "add_special_tokens"}


def test_end_to_end_the_client_gets_the_answer_the_text_prompt_gets() -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 30

    async def go() -> None:
        async with sim_fleet(2, router=send_ids()) as r:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 12}
            resp = await r.client.post(COMPLETIONS, json=body)
            assert resp.status_code == 200, resp.text
            routed = resp.json()
            worker = resp.headers["x-kvroute-worker"]
            await r.events_applied()
            async with httpx.AsyncClient() as c:
                direct = (await c.post(r.engines[worker].url + COMPLETIONS, json=body)).json()
            assert routed["object"] == "text_completion"
            assert routed["choices"][0]["text"] == direct["choices"][0]["text"]
            assert routed["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
            # the text sent directly hit the whole prompt the ids had cached: the same ids
            cached = direct["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= direct["usage"]["prompt_tokens"] - 16

            # streamed without usage asked for: the same text, no usage chunk for the client
            async with r.client.stream("POST", COMPLETIONS, json={**body, "stream": True}) as s:
                assert s.status_code == 200
                raw = b"".join([part async for part in s.aiter_bytes()])
            events = [e[6:] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert (
                "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
                == (direct["choices"][0]["text"])
            )
            assert not any(c.get("usage") for c in chunks)

            # echo needs the text: sent as the client wrote it
            resp = await r.client.post(COMPLETIONS, json={**body, "echo": True})
            assert resp.status_code == 200, resp.text
            # a prompt the client sent as ids goes as it came, counted apart from a failed encode
            ids_body = {**body, "prompt": direct["usage"]["prompt_tokens"] * [11]}
            resp = await r.client.post(COMPLETIONS, json=ids_body)
            assert resp.status_code == 200, resp.text
            assert sent_as_ids(r, COMPLETIONS) == {"yes": 2.0, "not_plain": 1.0, "given_ids": 1.0}
            assert sent_as_ids(r) == {}  # no chat request was made

    asyncio.run(go())


def test_end_to_end_off_by_default() -> None:
    async def go() -> None:
        async with sim_fleet(1) as r:
            resp = await r.client.post(
                COMPLETIONS, json={"model": MODEL, "prompt": "hello there", "max_tokens": 3}
            )
            assert resp.status_code == 200, resp.text
            assert sent_as_ids(r, COMPLETIONS) == {}

    asyncio.run(go())
