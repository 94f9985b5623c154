"""`Tokenizers`, the router's entry point: modes, errors, metrics, the render endpoint over real
HTTP on loopback, concurrency, and that tokenization does not stall the event loop."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from kvroute.router.tokenize import TokenizedPrompt, TokenizeError, Tokenizers, TokenizerSpec
from kvroute.router.tokenize.local import LocalTokenizer
from kvroute.router.tokenize.prefix_cache import PrefixCache
from kvroute.sim.api.responses_request import render_responses
from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.server import SimEngineThread
from kvroute.sim.tokenizer import SimTokenizer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    v = registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def _chat(*texts: str) -> dict[str, Any]:
    msgs = []
    for i, t in enumerate(texts):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return {"model": "m", "messages": msgs}


def _reference(model_dir: Path) -> LocalTokenizer:
    return LocalTokenizer.from_spec(
        TokenizerSpec("local", path=str(model_dir)), cache=PrefixCache(0, 0)
    )


def run(coro_fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(coro_fn())


# ---- local mode -----------------------------------------------------------------------------


def test_local_mode_gives_exact_ids_and_counts(model_dirs: dict[str, Path]) -> None:
    reg = CollectorRegistry()
    spec = TokenizerSpec("local", path=str(model_dirs["chatml"]))
    body = _chat("hello there", "hi!", "how are you?")
    frozen = copy.deepcopy(body)

    async def go() -> TokenizedPrompt | None:
        tz = Tokenizers({"m": spec}, registry=reg)
        await tz.start()
        try:
            return await tz.token_ids("m", CHAT, body, None)
        finally:
            await tz.aclose()

    got = run(go)
    assert got is not None and got.source == "local"
    assert got.token_ids == _reference(model_dirs["chatml"]).chat_ids(body)[0]
    assert body == frozen
    assert _value(reg, "kvroute_tokenize_requests_total", model="m", outcome="local") == 1
    assert _value(reg, "kvroute_tokenize_prefix_cache_lookups_total", result="miss") == 1
    assert _value(reg, "kvroute_tokenize_prompt_tokens_total", model="m", kind="encoded") == len(
        got.token_ids
    )
    assert _value(reg, "kvroute_tokenize_seconds_count", mode="local") == 1


def test_second_turn_reuses_the_first(model_dirs: dict[str, Path]) -> None:
    reg = CollectorRegistry()
    spec = TokenizerSpec("local", path=str(model_dirs["chatml"]))

    async def go() -> None:
        tz = Tokenizers({"m": spec}, registry=reg)
        first = await tz.token_ids("m", CHAT, _chat("tell me a story " * 30), None)
        second = await tz.token_ids(
            "m", CHAT, _chat("tell me a story " * 30, "once upon a time", "go on"), None
        )
        assert first is not None and second is not None
        assert second.token_ids[: len(first.token_ids) - 3] == first.token_ids[:-3]
        await tz.aclose()

    run(go)
    assert _value(reg, "kvroute_tokenize_prefix_cache_lookups_total", result="hit") == 1
    assert _value(reg, "kvroute_tokenize_prompt_tokens_total", model="m", kind="reused") > 100
    assert _value(reg, "kvroute_tokenize_prefix_cache_entries") >= 1


def test_short_encodes_stay_on_the_loop_long_ones_use_the_pool(
    model_dirs: dict[str, Path],
) -> None:
    """Text beyond the prefix cache up to inline_chars is encoded inline (no thread), more
    in the pool; the ids are the same either way."""
    spec = TokenizerSpec("local", path=str(model_dirs["chatml"]))
    ref = _reference(model_dirs["chatml"])
    history = "tell me a story " * 600  # ~9,600 characters

    async def go() -> None:
        tz = Tokenizers({"m": spec}, inline_chars=2048)
        await tz.start()  # loads the tokenizer in the pool
        assert tz._executor is not None
        tz._executor.shutdown(wait=True)
        tz._executor = None
        try:
            short = await tz.token_ids("m", CHAT, _chat("hello there"), None)
            assert tz._executor is None  # no thread was needed
            first = await tz.token_ids("m", CHAT, _chat(history), None)
            assert tz._executor is not None  # 9,600 new characters: encoded in the pool
            tz._executor.shutdown(wait=True)
            tz._executor = None
            turn = _chat(history, "once upon a time", "go on")
            second = await tz.token_ids("m", CHAT, turn, None)
            assert tz._executor is None  # only the new turn was encoded, inline
            for got, body in ((short, _chat("hello there")), (first, _chat(history))):
                assert got is not None and got.token_ids == ref.chat_ids(body)[0]
            assert second is not None and second.token_ids == ref.chat_ids(turn)[0]
        finally:
            await tz.aclose()

    run(go)


def test_partial_ids_are_the_cached_start_and_finish_gives_the_whole(
    model_dirs: dict[str, Path],
) -> None:
    """With partial_min_chars, a turn whose history is cached and whose new text is long
    comes back as the history's exact ids plus what is pending; `finish` gives exactly the
    ids of a full tokenization. A short new text, a first turn, or partial off: whole ids."""
    reg = CollectorRegistry()
    spec = TokenizerSpec("local", path=str(model_dirs["chatml"]))
    ref = _reference(model_dirs["chatml"])
    history = "tell me a story " * 60
    reply = "once upon a time there was a router that knew every cache. " * 20  # 1,200 chars
    turn = _chat(history, reply, "go on")

    async def go() -> None:
        tz = Tokenizers({"m": spec}, registry=reg)
        try:
            first = await tz.token_ids("m", CHAT, _chat(history), None, partial_min_chars=512)
            assert first is not None and first.pending is None  # nothing cached yet: whole
            got = await tz.token_ids("m", CHAT, turn, None, partial_min_chars=512)
            assert got is not None and got.pending is not None
            whole = ref.chat_ids(turn)[0]
            assert 0 < len(got.token_ids) < len(whole)
            assert list(got.token_ids) == whole[: len(got.token_ids)]  # an exact start
            # the estimate is of the right size (the reply is ~250 tokens)
            assert abs(got.pending.estimated_tokens - len(whole)) < 0.5 * (
                len(whole) - len(got.token_ids)
            )
            tz._cache.clear()  # the start's entry evicted meanwhile: its ids are still right
            done = await tz.finish(got)
            assert done is not None and done.pending is None and done.token_ids == whole
            assert await tz.finish(done) is done  # already whole
            # a short new text, or partial off: encoded at once
            short = _chat(history, "ok", "go on")
            assert (
                await tz.token_ids("m", CHAT, short, None, partial_min_chars=512)
            ).pending is None  # type: ignore[union-attr]
            again = _chat(history, reply + " more", "go on")
            full = await tz.token_ids("m", CHAT, again, None)
            assert full is not None and full.pending is None
            assert full.token_ids == ref.chat_ids(again)[0]
        finally:
            await tz.aclose()

    run(go)
    assert _value(reg, "kvroute_tokenize_seconds_count", mode="local_rest") == 1


def test_a_first_turn_sharing_a_system_prompt_is_routed_on_it(
    model_dirs: dict[str, Path],
) -> None:
    """Another conversation's first turn that opens with a system prompt the router has
    tokenized before comes back partial: the system prompt's exact ids, its own long message
    pending (before, only the same conversation's next turn hit the cache)."""
    spec = TokenizerSpec("local", path=str(model_dirs["chatml"]))
    ref = _reference(model_dirs["chatml"])
    system = {"role": "system", "content": "You are the fleet's coding agent. " * 40}

    def first_turn(question: str) -> dict[str, Any]:
        return {"model": "m", "messages": [system, {"role": "user", "content": question}]}

    async def go() -> None:
        tz = Tokenizers({"m": spec})
        try:
            one = await tz.token_ids(
                "m", CHAT, first_turn("why? " * 150), None, partial_min_chars=512
            )
            assert one is not None and one.pending is None  # nothing cached yet: whole
            other = first_turn("how does the cache work? " * 40)
            got = await tz.token_ids("m", CHAT, other, None, partial_min_chars=512)
            assert got is not None and got.pending is not None
            whole = ref.chat_ids(other)[0]
            system_ids = ref.encoder.encode(system["content"])
            assert len(system_ids) <= len(got.token_ids) < len(whole)
            assert list(got.token_ids) == whole[: len(got.token_ids)]
            done = await tz.finish(got)
            assert done is not None and done.token_ids == whole
        finally:
            await tz.aclose()

    run(go)


def test_partial_rest_that_fails_gives_none_and_is_counted(model_dirs: dict[str, Path]) -> None:
    """The rest of a partial prompt is encoded after dispatch: a failure there (here the
    prompt bound) returns None instead of raising, and is counted."""
    reg = CollectorRegistry()
    spec = TokenizerSpec("local", path=str(model_dirs["chatml"]), max_prompt_tokens=600)
    history = "tell me a story " * 40  # ~450 tokens
    turn = _chat(history, "and then " * 100, "go on")

    async def go() -> None:
        tz = Tokenizers({"m": spec}, registry=reg)
        try:
            await tz.token_ids("m", CHAT, _chat(history), None)
            got = await tz.token_ids("m", CHAT, turn, None, partial_min_chars=256)
            assert got is not None and got.pending is not None
            assert await tz.finish(got) is None
            with pytest.raises(TokenizeError):  # the same request, encoded first: a 400
                await tz.token_ids("m", CHAT, turn, None)
        finally:
            await tz.aclose()

    run(go)
    assert _value(reg, "kvroute_tokenize_unavailable_total", model="m", reason="rest_messages") == 1


def test_remembered_answers_are_bounded_counted_and_used(model_dirs: dict[str, Path]) -> None:
    """Answers wait for a thread of their own (8 at most, more are dropped as busy);
    a remembered answer makes the next turn a cache hit through it; a model without a local
    tokenizer remembers nothing."""
    reg = CollectorRegistry()
    spec = TokenizerSpec("local", path=str(model_dirs["chatml"]))
    first = _chat("question " * 40)
    answer = "an answer " * 60

    async def go() -> None:
        tz = Tokenizers({"m": spec}, registry=reg, threads=1)
        await tz.start()
        await tz.token_ids("m", CHAT, first, None)
        accepted = [tz.remember_answer("m", first, lambda: answer) for _ in range(10)]
        assert accepted == [True] * 8 + [False] * 2
        assert _value(reg, "kvroute_tokenize_answers_total", model="m", result="busy") == 2
        while tz._answer_tasks:
            await asyncio.sleep(0.01)
        remembered = _value(reg, "kvroute_tokenize_answers_total", model="m", result="remembered")
        nothing = _value(reg, "kvroute_tokenize_answers_total", model="m", result="nothing_new")
        assert (remembered, nothing) == (1, 7)  # the same answer eight times: encoded once
        assert _value(reg, "kvroute_tokenize_prompt_tokens_total", model="m", kind="answer") > 0
        before = _value(reg, "kvroute_tokenize_prompt_tokens_total", model="m", kind="encoded")
        nxt = _chat("question " * 40, answer, "thanks")
        got = await tz.token_ids("m", CHAT, nxt, None)
        assert (
            got is not None and got.token_ids == _reference(model_dirs["chatml"]).chat_ids(nxt)[0]
        )
        encoded = _value(reg, "kvroute_tokenize_prompt_tokens_total", model="m", kind="encoded")
        assert encoded - before < 20  # "thanks" and the markers around it
        assert not tz.remember_answer("other", first, lambda: answer)  # no tokenizer for it
        await tz.aclose()

    run(go)


def test_a_request_never_waits_behind_remembered_answers(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Answers have their own thread: with it stuck, a request's encode (in the pool, as
    inline_chars=0 sends every encode there) still completes."""
    spec = TokenizerSpec("local", path=str(model_dirs["chatml"]))
    release = threading.Event()

    def stuck(self: LocalTokenizer, body: Any, answer: str) -> int:
        release.wait(10)
        return 0

    monkeypatch.setattr(LocalTokenizer, "remember_answer", stuck)

    async def go() -> None:
        tz = Tokenizers({"m": spec}, threads=1, inline_chars=0)
        await tz.start()
        body = _chat("question " * 40)
        assert all(tz.remember_answer("m", body, lambda: "answer") for _ in range(8))
        try:
            got = await asyncio.wait_for(tz.token_ids("m", CHAT, _chat("other " * 50), None), 5)
            assert got is not None and got.token_ids
        finally:
            release.set()
            await tz.aclose()

    run(go)


def test_unknown_model_without_default_gets_none(model_dirs: dict[str, Path]) -> None:
    reg = CollectorRegistry()

    async def go() -> TokenizedPrompt | None:
        tz = Tokenizers({}, registry=reg)
        return await tz.token_ids("other", CHAT, _chat("x"), None)

    assert run(go) is None
    assert (
        _value(reg, "kvroute_tokenize_unavailable_total", model="_default", reason="no_spec") == 1
    )


def test_default_spec_serves_unlisted_models(model_dirs: dict[str, Path]) -> None:
    default = TokenizerSpec("local", path=str(model_dirs["llama3"]))

    async def go() -> TokenizedPrompt | None:
        tz = Tokenizers({}, default=default)
        out = await tz.token_ids("anything", CHAT, _chat("x"), None)
        await tz.aclose()
        return out

    got = run(go)
    assert (
        got is not None
        and got.token_ids == _reference(model_dirs["llama3"]).chat_ids(_chat("x"))[0]
    )


def test_malformed_requests_raise_tokenize_error(model_dirs: dict[str, Path]) -> None:
    reg = CollectorRegistry()
    spec = TokenizerSpec("local", path=str(model_dirs["chatml"]))
    bad = [
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": [{"content": "no role"}]}, "messages"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, None),  # template
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "chat_template": "{{ 1 }}",
            },
            "chat_template",
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "chat_template_kwargs": {"conversation": []},
            },
            "chat_template_kwargs",
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "reasoning_effort": "max!",
            },
            "reasoning_effort",
        ),
    ]

    async def go() -> None:
        tz = Tokenizers({"m": spec}, registry=reg)
        for body, param in bad:
            with pytest.raises(TokenizeError) as info:
                await tz.token_ids("m", CHAT, body, None)
            assert info.value.param == param, body
            assert str(info.value)
        await tz.aclose()

    run(go)
    assert _value(reg, "kvroute_tokenize_requests_total", model="m", outcome="client_error") == len(
        bad
    )


def test_request_templates_only_when_trusted(model_dirs: dict[str, Path]) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}",
    }

    async def go(trust: bool) -> TokenizedPrompt | None:
        spec = TokenizerSpec(
            "local", path=str(model_dirs["chatml"]), trust_request_chat_template=trust
        )
        tz = Tokenizers({"m": spec})
        try:
            return await tz.token_ids("m", CHAT, body, None)
        finally:
            await tz.aclose()

    with pytest.raises(TokenizeError):
        run(lambda: go(False))
    got = run(lambda: go(True))
    ref = _reference(model_dirs["chatml"])
    assert got is not None and got.token_ids == ref.encoder.encode("<|im_start|>x")


def test_ids_the_engine_uses_are_taken_in_every_mode(model_dirs: dict[str, Path]) -> None:
    ref = _reference(model_dirs["chatml"])
    vocab = ref.vocab_size

    async def go() -> None:
        local = Tokenizers({"m": TokenizerSpec("local", path=str(model_dirs["chatml"]))})
        got = await local.token_ids("m", COMPLETIONS, {"model": "m", "prompt": [1, 2, 3]}, None)
        assert got == TokenizedPrompt([1, 2, 3], "request")
        got = await local.token_ids("m", COMPLETIONS, {"model": "m", "prompt": [[4, 5], [6]]}, None)
        assert got == TokenizedPrompt([4, 5], "request")
        with pytest.raises(TokenizeError) as info:
            await local.token_ids("m", COMPLETIONS, {"model": "m", "prompt": [vocab]}, None)
        assert info.value.param == "prompt"
        # vLLM's decode-side field: the engine prefills exactly these
        body = {**_chat("x"), "kv_transfer_params": {"prompt_token_ids": [7, 8, 9]}}
        assert await local.token_ids("m", CHAT, body, None) == TokenizedPrompt([7, 8, 9], "request")
        # ... except with echo, where vLLM renders the messages instead
        got = await local.token_ids("m", CHAT, {**body, "echo": True}, None)
        assert got is not None and got.source == "local"
        # the kvroute extension field is NOT trusted in local mode: ids come from the messages
        got = await local.token_ids("m", CHAT, {**_chat("x"), "prompt_token_ids": [1]}, None)
        assert got is not None and got.token_ids == ref.chat_ids(_chat("x"))[0]
        await local.aclose()

    run(go)


def test_request_mode(model_dirs: dict[str, Path]) -> None:
    reg = CollectorRegistry()
    spec = TokenizerSpec("request", vocab_size=1000, max_prompt_tokens=8)

    async def go() -> None:
        tz = Tokenizers({"m": spec}, registry=reg)
        assert await tz.token_ids("m", CHAT, {**_chat("x"), "prompt_token_ids": [5, 6]}, None) == (
            TokenizedPrompt([5, 6], "request")
        )
        assert await tz.token_ids("m", CHAT, _chat("x"), None) is None
        assert await tz.token_ids("m", COMPLETIONS, {"model": "m", "prompt": "text"}, None) is None
        for ids in ([], [1, True], [1.0], ["1"], [-1], [1000], list(range(9)), "1,2"):
            with pytest.raises(TokenizeError) as info:
                await tz.token_ids("m", CHAT, {**_chat("x"), "prompt_token_ids": ids}, None)
            assert info.value.param == "prompt_token_ids"
        await tz.aclose()

    run(go)
    assert (
        _value(reg, "kvroute_tokenize_unavailable_total", model="m", reason="no_ids_in_request")
        == 2
    )


def test_unsupported_requests_route_without_ids(model_dirs: dict[str, Path]) -> None:
    reg = CollectorRegistry()
    spec = TokenizerSpec("local", path=str(model_dirs["chatml"]))
    image = {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}
    cases = [
        (CHAT, {"model": "m", "messages": [{"role": "user", "content": [image]}]}, "multimodal"),
        (CHAT, {**_chat("x"), "truncate_prompt_tokens": 5}, "truncation"),
        (COMPLETIONS, {"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
        (
            "/v1/responses",
            {"model": "m", "input": "x", "previous_response_id": "r"},
            "responses_history",
        ),
        ("/v1/responses", {"model": "m", "input": "x", "reasoning": {}}, "responses_reasoning"),
    ]

    async def go() -> None:
        tz = Tokenizers({"m": spec}, registry=reg)
        for endpoint, body, _ in cases:
            assert await tz.token_ids("m", endpoint, body, None) is None
        await tz.aclose()

    run(go)
    for _, _, reason in cases:
        assert _value(reg, "kvroute_tokenize_unavailable_total", model="m", reason=reason) == 1


def test_responses_input_is_tokenized_locally(model_dirs: dict[str, Path]) -> None:
    """A Responses body gets the ids of its conversation (instructions as the system message,
    the input as the user's), with the special tokens that endpoint adds."""
    spec = TokenizerSpec("local", path=str(model_dirs["chatml"]))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = {"model": "m", "messages": messages, "add_special_tokens": True}
    body = {"model": "m", "instructions": "be brief", "input": "hi"}
    listed = {"model": "m", "instructions": "be brief", "input": [messages[1]]}

    async def go() -> None:
        tz = Tokenizers({"m": spec}, registry=CollectorRegistry())
        want = await tz.token_ids("m", CHAT, chat, None)
        assert want is not None and want.source == "local"
        for request in (body, listed):
            got = await tz.token_ids("m", "/v1/responses", request, None)
            assert got == want
        with pytest.raises(TokenizeError) as info:
            await tz.token_ids("m", "/v1/responses", {"model": "m", "input": [5]}, None)
        assert info.value.param == "input"
        await tz.aclose()

    run(go)


def test_embeddings_text_input(model_dirs: dict[str, Path]) -> None:
    ref = _reference(model_dirs["metaspace"])

    async def go() -> TokenizedPrompt | None:
        tz = Tokenizers({"m": TokenizerSpec("local", path=str(model_dirs["metaspace"]))})
        out = await tz.token_ids(
            "m", "/v1/embeddings", {"model": "m", "input": ["hello router", "b"]}, None
        )
        await tz.aclose()
        return out

    got = run(go)
    assert got is not None and got.token_ids == ref.encoder.encode(
        "hello router", add_special_tokens=True
    )


def test_broken_model_directory_is_logged_and_not_retried_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reg = CollectorRegistry()
    (tmp_path / "tokenizer.json").write_text("{not json")
    spec = TokenizerSpec("local", path=str(tmp_path))

    async def go() -> None:
        tz = Tokenizers({"m": spec}, registry=reg)
        await tz.start()
        for _ in range(3):
            assert await tz.token_ids("m", CHAT, _chat("x"), None) is None
        await tz.aclose()

    run(go)
    assert _value(reg, "kvroute_tokenize_load_failures_total", model="m") == 1
    assert _value(reg, "kvroute_tokenize_unavailable_total", model="m", reason="load_failed") == 3
    assert sum("cannot load the tokenizer" in r.message for r in caplog.records) == 1


def test_concurrent_calls_give_the_same_ids_as_sequential(model_dirs: dict[str, Path]) -> None:
    spec = TokenizerSpec("local", path=str(model_dirs["chatml"]))
    ref = _reference(model_dirs["chatml"])
    bodies = [
        _chat(*[f"conversation {c} turn {t} " * 5 for t in range(1 + c % 5)]) for c in range(60)
    ]

    async def go() -> list[TokenizedPrompt | None]:
        tz = Tokenizers({"m": spec}, threads=2)
        out = await asyncio.gather(*(tz.token_ids("m", CHAT, b, None) for b in bodies * 2))
        await tz.aclose()
        return list(out)

    got = run(go)
    for body, result in zip(bodies * 2, got, strict=True):
        assert result is not None and result.token_ids == ref.chat_ids(body)[0]


def test_tokenization_does_not_stall_the_event_loop(model_dirs: dict[str, Path]) -> None:
    """A long prompt is tokenized while a ticker keeps running on the loop. (If the tokenizer
    held the GIL, as `Tokenizer.encode` does, the ticker would stop for the whole encode.)"""
    spec = TokenizerSpec("local", path=str(model_dirs["chatml"]))
    words = "router cache prefix tokens worker 12345 café "
    prompt = words * 8000  # ~360K chars, ~100K tokens

    async def go() -> tuple[int, float]:
        tz = Tokenizers({"m": spec}, threads=1)
        await tz.start()
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                await asyncio.sleep(0.002)
                ticks += 1

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        ticks = 0
        started = time.perf_counter()
        got = await tz.token_ids("m", COMPLETIONS, {"model": "m", "prompt": prompt}, None)
        elapsed = time.perf_counter() - started
        done.set()
        await task
        await tz.aclose()
        assert got is not None and len(got.token_ids) > 50_000
        return ticks, elapsed

    ticks, elapsed = run(go)
    # The ticker should run for most of the encode; allow a wide margin for a busy machine.
    assert ticks >= max(3, int(elapsed / 0.002 * 0.2)), (ticks, elapsed)


# ---- render mode over real HTTP ---------------------------------------------------------------


class FakeEngine:
    """vLLM's render and tokenize endpoints on loopback, answering with a local tokenizer."""

    def __init__(self, model_dir: Path) -> None:
        self.tok = _reference(model_dir)
        self.render_status = 200
        self.delay_s = 0.0
        self.garbage = False
        self.hits: dict[str, int] = {}
        self.bodies: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions/render", self._render_chat)
        app.router.add_post("/v1/completions/render", self._render_completion)
        app.router.add_post("/tokenize", self._tokenize)
        return app

    async def _pre(self, request: web.Request) -> dict[str, Any] | web.Response:
        self.hits[request.path] = self.hits.get(request.path, 0) + 1
        body: dict[str, Any] = await request.json()
        self.bodies.append(body)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.garbage:
            return web.Response(text="<html>oops", content_type="text/html")
        return body

    async def _render_chat(self, request: web.Request) -> web.Response:
        body = await self._pre(request)
        if isinstance(body, web.Response):
            return body
        if self.render_status != 200:
            return web.json_response({"error": "no"}, status=self.render_status)
        ids, _ = self.tok.chat_ids(body)
        return web.json_response({"request_id": "x", "token_ids": ids, "model": body["model"]})

    async def _render_completion(self, request: web.Request) -> web.Response:
        body = await self._pre(request)
        if isinstance(body, web.Response):
            return body
        if self.render_status != 200:
            return web.json_response({"error": "no"}, status=self.render_status)
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        out = [{"token_ids": self.tok.completion_ids({"prompt": p})[0]} for p in prompts]
        return web.json_response(out)

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self._pre(request)
        if isinstance(body, web.Response):
            return body
        if "messages" in body:
            ids, _ = self.tok.chat_ids(body)
        else:
            ids, _ = self.tok.text_ids(body["prompt"], body.get("add_special_tokens", True))
        return web.json_response({"count": len(ids), "max_model_len": 4096, "tokens": ids})


@asynccontextmanager
async def serve(engine: FakeEngine) -> AsyncIterator[str]:
    runner = web.AppRunner(engine.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_render_mode(model_dirs: dict[str, Path]) -> None:
    reg = CollectorRegistry()
    engine = FakeEngine(model_dirs["chatml"])
    spec = TokenizerSpec("render")
    body = {
        **_chat("hi", "hello", "bye"),
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def go() -> None:
        tz = Tokenizers({"m": spec}, registry=reg, render_timeout_s=1.0)
        async with serve(engine) as url:
            got = await tz.token_ids("m", CHAT, body, url)
            assert got == TokenizedPrompt(engine.tok.chat_ids(body)[0], "render")
            assert (
                "stream" not in engine.bodies[-1]
                and engine.bodies[-1]["messages"] == body["messages"]
            )
            got = await tz.token_ids(
                "m", COMPLETIONS, {"model": "m", "prompt": ["first one", "b"]}, url
            )
            assert (
                got is not None
                and got.token_ids == engine.tok.completion_ids({"prompt": "first one"})[0]
            )
            assert await tz.token_ids("m", CHAT, body, None) is None  # no worker
        await tz.aclose()

    run(go)
    assert _value(reg, "kvroute_tokenize_requests_total", model="m", outcome="render") == 2
    assert _value(reg, "kvroute_tokenize_unavailable_total", model="m", reason="no_worker") == 1


def test_render_falls_back_to_tokenize_and_remembers(model_dirs: dict[str, Path]) -> None:
    engine = FakeEngine(model_dirs["chatml"])
    engine.render_status = 403  # vLLM without --enable-scale-out
    body = _chat("hi", "hello", "bye")

    async def go() -> None:
        tz = Tokenizers({"m": TokenizerSpec("render")}, render_timeout_s=1.0)
        async with serve(engine) as url:
            for _ in range(3):
                got = await tz.token_ids("m", CHAT, body, url)
                assert got == TokenizedPrompt(engine.tok.chat_ids(body)[0], "render")
            # documents cannot go through /tokenize: no ids rather than wrong ids
            assert (
                await tz.token_ids(
                    "m", CHAT, {**body, "documents": [{"title": "t", "text": "x"}]}, url
                )
                is None
            )
        await tz.aclose()

    run(go)
    assert engine.hits["/v1/chat/completions/render"] == 1
    assert engine.hits["/tokenize"] == 3


RESPONSES_BODY = {
    "model": "kvroute-sim",
    "instructions": "Answer briefly.",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "what is a block?"}]},
        {"type": "message", "role": "assistant", "content": "A unit of KV cache."},
        {"role": "user", "content": "and a page?"},
    ],
    "stream": True,
}


def test_render_mode_responses_from_a_simulated_engine() -> None:
    """The ids of a Responses request from the engine's /v1/responses/render, and through
    /tokenize (as the conversation vLLM renders) where render is refused: both the ids the
    engine prefills."""
    want = render_responses(RESPONSES_BODY, SimTokenizer())[1]

    async def go(url: str) -> None:
        tz = Tokenizers({"kvroute-sim": TokenizerSpec("render")}, render_timeout_s=5.0)
        got = await tz.token_ids("kvroute-sim", "/v1/responses", RESPONSES_BODY, url)
        assert got == TokenizedPrompt(want, "render")
        await tz.aclose()

    with SimEngineThread(EngineConfig(speed=100)) as sim:
        run(lambda: go(sim.url))


def test_render_falls_back_to_tokenize_for_responses(model_dirs: dict[str, Path]) -> None:
    engine = FakeEngine(model_dirs["chatml"])
    engine.render_status = 403  # vLLM without --enable-scale-out
    body = {**RESPONSES_BODY, "model": "m"}

    async def go() -> None:
        tz = Tokenizers({"m": TokenizerSpec("render")}, render_timeout_s=1.0)
        async with serve(engine) as url:
            got = await tz.token_ids("m", "/v1/responses", body, url)
            sent = engine.bodies[-1]
            assert sent["add_special_tokens"] is True and sent["add_generation_prompt"] is True
            assert sent["messages"][0] == {"role": "system", "content": "Answer briefly."}
            assert got == TokenizedPrompt(engine.tok.chat_ids(sent)[0], "render")
            with_history = {**body, "previous_response_id": "resp_1"}
            assert await tz.token_ids("m", "/v1/responses", with_history, url) is None
        await tz.aclose()

    run(go)
    assert engine.hits["/tokenize"] == 1


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        (lambda e: setattr(e, "render_status", 500), "render_http_5xx"),
        (lambda e: setattr(e, "render_status", 400), "render_http_4xx"),
        (lambda e: setattr(e, "delay_s", 1.0), "render_timeout"),
        (lambda e: setattr(e, "garbage", True), "render_bad_response"),
    ],
)
def test_render_failures_give_none(
    model_dirs: dict[str, Path], setup: Callable[[FakeEngine], None], reason: str
) -> None:
    reg = CollectorRegistry()
    engine = FakeEngine(model_dirs["chatml"])
    setup(engine)

    async def go() -> None:
        tz = Tokenizers({"m": TokenizerSpec("render")}, registry=reg, render_timeout_s=0.3)
        async with serve(engine) as url:
            assert await tz.token_ids("m", CHAT, _chat("x"), url) is None
        await tz.aclose()

    run(go)
    assert _value(reg, "kvroute_tokenize_unavailable_total", model="m", reason=reason) == 1


def test_render_unreachable_worker(model_dirs: dict[str, Path]) -> None:
    reg = CollectorRegistry()

    async def go() -> None:
        engine = FakeEngine(model_dirs["chatml"])
        async with serve(engine) as url:
            pass  # the port is closed again now
        tz = Tokenizers({"m": TokenizerSpec("render")}, registry=reg, render_timeout_s=0.5)
        assert await tz.token_ids("m", CHAT, _chat("x"), url) is None
        await tz.aclose()

    run(go)
    assert (
        _value(reg, "kvroute_tokenize_unavailable_total", model="m", reason="render_unreachable")
        == 1
    )


def test_render_uses_an_injected_transport(model_dirs: dict[str, Path]) -> None:
    """The router passes its own pooled HTTP client (`post_json`); no session of our own."""
    engine = FakeEngine(model_dirs["chatml"])
    calls: list[str] = []

    class Poster:
        async def post_json(self, url: str, payload: Any, timeout_s: float) -> tuple[int, bytes]:
            calls.append(url)
            ids = engine.tok.chat_ids(payload)[0]
            return 200, json.dumps({"token_ids": ids}).encode()

    async def go() -> TokenizedPrompt | None:
        tz = Tokenizers({"m": TokenizerSpec("render")}, http=Poster())
        out = await tz.token_ids("m", CHAT, _chat("x"), "http://127.0.0.1:9/")
        await tz.aclose()
        return out

    got = run(go)
    assert got is not None and got.source == "render"
    assert calls == ["http://127.0.0.1:9/v1/chat/completions/render"]


# ---- the check tool ---------------------------------------------------------------------------


def test_check_tool_against_an_engine(
    model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from kvroute.router.tokenize import check

    async def go(engine_dir: Path, local_dir: Path) -> int:
        engine = FakeEngine(engine_dir)
        local = _reference(local_dir)
        async with serve(engine) as url:
            from kvroute.router.tokenize.render_client import AiohttpPoster

            poster = AiohttpPoster()
            try:
                return await check.run_check(local, url, "m", poster)
            finally:
                await poster.aclose()

    assert run(lambda: go(model_dirs["chatml"], model_dirs["chatml"])) == 0
    assert "ok    chat: tools and a tool call" in capsys.readouterr().out
    # an engine with another tokenizer: the tool reports the difference
    assert run(lambda: go(model_dirs["llama3"], model_dirs["chatml"])) == 1
    assert "DIFF" in capsys.readouterr().out
    assert check.main(["--model-dir", "/nonexistent", "--engine", "http://127.0.0.1:9"]) == 2


def test_workers_without_render_routes_are_remembered_within_a_bound() -> None:
    from kvroute.router.tokenize import render_client

    class NoRender:
        async def post_json(self, url: str, payload: Any, timeout_s: float) -> tuple[int, bytes]:
            if url.endswith("/render"):
                return 403, b"{}"
            return 200, json.dumps({"tokens": [1, 2]}).encode()

    client = render_client.RenderClient(NoRender(), 1.0)

    async def go() -> None:
        for i in range(render_client._REMEMBERED_WORKERS + 3):
            res = await client.ids(CHAT, _chat("x"), f"http://127.0.0.1:{i}")
            assert res.ids == [1, 2]

    run(go)
    assert len(client._no_render) == render_client._REMEMBERED_WORKERS
    assert "http://127.0.0.1:0" not in client._no_render
