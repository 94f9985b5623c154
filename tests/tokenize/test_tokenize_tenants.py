"""The prefix cache keeps tenants apart: the same text under another cache_salt or LoRA
adapter never hits (nor adds to) the first tenant's entries, and remembered answers too."""

from __future__ import annotations

from kvroute.router.tokenize.local import LocalTokenizer
from kvroute.router.tokenize.prefix_cache import PrefixCache, tenant_key
from kvroute.router.tokenize.spec import TokenizerSpec
from kvroute.sim.model import MODEL_DIR

SYSTEM = {"role": "system", "content": "You are a careful coding agent. Tools: " * 60}


def _tok() -> LocalTokenizer:
    return LocalTokenizer.from_spec(
        TokenizerSpec("local", path=str(MODEL_DIR)), cache=PrefixCache(256, 1 << 26)
    )


def _ids(
    tok: LocalTokenizer, messages: list[dict[str, str]], tenant: bytes
) -> tuple[list[int], bool]:
    text, _ = tok.render_chat({"model": "m", "messages": messages})
    ids, stats = tok.text_ids(text, False, tenant=tenant)
    return ids, stats.cache_hit


def test_identical_text_of_two_tenants_gets_two_entries() -> None:
    tok = _tok()
    a, b = tenant_key("", "salt-of-a"), tenant_key("", "salt-of-b")
    convo = [SYSTEM, {"role": "user", "content": "open the file main.py " * 5}]
    ids_a, hit = _ids(tok, convo, a)
    assert not hit
    entries = tok.cache.stats().entries
    ids_b, hit_b = _ids(tok, convo, b)
    assert not hit_b  # A's entry is not B's
    assert tok.cache.stats().entries > entries  # B filed entries of its own
    assert ids_a == ids_b
    assert _ids(tok, convo, a)[1] and _ids(tok, convo, b)[1]  # each hits its own
    assert not _ids(tok, convo, b"")[1]  # nor does an unsalted request hit either


def test_lora_name_is_part_of_the_key_and_keys_do_not_collide() -> None:
    tok = _tok()
    convo = [SYSTEM, {"role": "user", "content": "list every failing test " * 5}]
    _ids(tok, convo, tenant_key("adapter-a", ""))
    assert not _ids(tok, convo, tenant_key("adapter-b", ""))[1]
    assert tenant_key("ab", "c") != tenant_key("a", "bc")
    assert tenant_key("", "") == b""


def test_a_remembered_answer_serves_only_its_own_tenant() -> None:
    tok = _tok()
    a, b = tenant_key("", "salt-of-a"), tenant_key("", "salt-of-b")
    convo = [SYSTEM, {"role": "user", "content": "what is in main.py? " * 5}]
    answer = "It defines the entry point and parses the arguments. " * 8
    assert tok.remember_answer({"model": "m", "messages": convo}, answer, a) > 0
    nxt = [*convo, {"role": "assistant", "content": answer}, {"role": "user", "content": "ok"}]
    text, _ = tok.render_chat({"model": "m", "messages": nxt})
    hit_a = tok.cached_prefix(text, a).hit
    hit_b = tok.cached_prefix(text, b).hit
    assert hit_a is not None and hit_a.anchor > len(text) // 2
    assert hit_b is None
