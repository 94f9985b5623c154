"""`/v1/completions` prompts (plain text, no chat template) through `Tokenizers`: a prompt that
extends one seen before encodes only its new text, per tenant, within the cache's bounds, and
the reuse is counted in the existing metrics."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from prometheus_client import CollectorRegistry

from kvroute.router.tokenize import Tokenizers, TokenizerSpec
from kvroute.router.tokenize.local import LocalTokenizer
from kvroute.router.tokenize.prefix_cache import PrefixCache, tenant_key
from kvroute.sim.model import MODEL_DIR

COMPLETIONS = "/v1/completions"
SPEC = TokenizerSpec("local", path=str(MODEL_DIR))


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    v = registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def _prose(seed: int, words: int) -> str:
    rng = random.Random(seed)
    vocab = ["the", "router", "keeps", "each", "worker's", "cache", "warm;", "12,345", "tokens"]
    return " ".join(rng.choice(vocab) for _ in range(words))


def _reference(body: dict[str, Any]) -> list[int]:
    ref = LocalTokenizer.from_spec(SPEC, cache=PrefixCache(0, 0))
    return ref.completion_ids(body)[0]


async def _ids(tz: Tokenizers, prompt: Any, tenant: bytes = b"") -> list[int]:
    got = await tz.token_ids(
        "m", COMPLETIONS, {"model": "m", "prompt": prompt}, None, tenant=tenant
    )
    assert got is not None and got.source == "local" and got.pending is None
    return got.token_ids


def test_an_extending_prompt_encodes_only_its_new_text() -> None:
    reg = CollectorRegistry()
    earlier = _prose(1, 4000)
    later = earlier + " " + _prose(2, 300)

    async def go() -> tuple[list[int], list[int]]:
        tz = Tokenizers({"m": SPEC}, registry=reg)
        await tz.start()
        try:
            first = await _ids(tz, earlier)
            encoded_first = _value(
                reg, "kvroute_tokenize_prompt_tokens_total", model="m", kind="encoded"
            )
            assert encoded_first >= len(first) - 1  # the whole prompt (BOS is not encoded)
            return first, await _ids(tz, [later])  # a list of one prompt: its first string
        finally:
            await tz.aclose()

    first, second = asyncio.run(go())
    assert first == _reference({"prompt": earlier})
    assert second == _reference({"prompt": later})
    assert second[0] == first[0]  # add_special_tokens (the default) kept the BOS token
    reused = _value(reg, "kvroute_tokenize_prompt_tokens_total", model="m", kind="reused")
    encoded = _value(reg, "kvroute_tokenize_prompt_tokens_total", model="m", kind="encoded")
    new = len(second) - len(first)
    assert reused >= len(first) - 32
    assert encoded - (len(first) - 1) <= new + 32  # the second request: its new text only
    assert _value(reg, "kvroute_tokenize_prefix_cache_lookups_total", result="hit") == 1
    assert _value(reg, "kvroute_tokenize_prefix_cache_lookups_total", result="miss") == 1


def test_a_prompt_never_reuses_another_tenants_text() -> None:
    reg = CollectorRegistry()
    earlier = _prose(3, 2000)
    later = earlier + " and then some more words"
    a, b = tenant_key("", "salt-a"), tenant_key("adapter-b", "")

    async def go() -> list[list[int]]:
        tz = Tokenizers({"m": SPEC}, registry=reg)
        await tz.start()
        try:
            return [
                await _ids(tz, earlier, a),
                await _ids(tz, later, b),  # another tenant: a miss
                await _ids(tz, later, b""),  # unsalted: a miss too
                await _ids(tz, later + " again", a),  # the first tenant: a hit
            ]
        finally:
            await tz.aclose()

    got = asyncio.run(go())
    assert got[1] == got[2] == _reference({"prompt": later})
    assert got[3] == _reference({"prompt": later + " again"})
    assert _value(reg, "kvroute_tokenize_prefix_cache_lookups_total", result="miss") == 3
    assert _value(reg, "kvroute_tokenize_prefix_cache_lookups_total", result="hit") == 1


def test_completions_entries_stay_within_the_byte_bound() -> None:
    reg = CollectorRegistry()
    budget = 64 << 10  # bytes: a few long prompts' ids at most

    async def go() -> list[tuple[str, list[int]]]:
        tz = Tokenizers({"m": SPEC}, registry=reg, cache_entries=1000, cache_bytes=budget)
        await tz.start()
        out = []
        try:
            for seed in range(8):
                prompt = _prose(10 + seed, 1500)
                out.append((prompt, await _ids(tz, prompt)))
                assert _value(reg, "kvroute_tokenize_prefix_cache_bytes") <= budget
        finally:
            await tz.aclose()
        return out

    for prompt, ids in asyncio.run(go()):
        assert ids == _reference({"prompt": prompt})
    assert _value(reg, "kvroute_tokenize_prefix_cache_evictions") > 0
