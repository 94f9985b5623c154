"""Prefix-cached ids equal a from-scratch tokenization, and the cache stays within its bounds."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenize_helpers import conversations, metaspace_conversations, text
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

from kvroute.router.tokenize.encoder import TextEncoder
from kvroute.router.tokenize.errors import TokenizeError
from kvroute.router.tokenize.local import LocalTokenizer
from kvroute.router.tokenize.prefix_cache import CHUNK_CHARS, PrefixCache, chunk_digests
from kvroute.router.tokenize.spec import TokenizerSpec

SCALE = int(os.environ.get("KVROUTE_TOKENIZE_SCALE", "1"))
FIXTURE_SETTINGS = settings(
    max_examples=150 * SCALE,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def _local(model_dir: Path, cache: PrefixCache | None = None) -> LocalTokenizer:
    return LocalTokenizer.from_spec(
        TokenizerSpec("local", path=str(model_dir)), cache=cache or PrefixCache(256, 1 << 26)
    )


_SHARED: dict[Path, LocalTokenizer] = {}


def _shared(model_dir: Path) -> LocalTokenizer:
    """One tokenizer per model for all examples of a property test: its cache accumulates
    entries from many conversations, which is the interesting case."""
    if model_dir not in _SHARED:
        _SHARED[model_dir] = _local(model_dir, PrefixCache(512, 1 << 26))
    return _SHARED[model_dir]


def _scratch(tok: LocalTokenizer, text_: str) -> list[int]:
    return tok.encoder.encode(text_)


# ---- the core property: cached == from scratch --------------------------------------------


SIM_MODEL = Path(__file__).resolve().parents[2] / "kvroute" / "sim" / "model"


@FIXTURE_SETTINGS
@given(
    kind=st.sampled_from(["chatml", "llama3", "sim"]),
    convo=conversations(),
    extra=st.lists(st.tuples(text, text), min_size=1, max_size=3),
)
def test_multi_turn_ids_equal_from_scratch(
    model_dirs: dict[str, Path], kind: str, convo: list[dict[str, Any]], extra: list[Any]
) -> None:
    """Turn after turn of one conversation: every turn's ids equal a full tokenization, and
    later turns reuse the earlier ones."""
    tok = _shared(SIM_MODEL if kind == "sim" else model_dirs[kind])
    messages = list(convo)
    for user_text, answer in [("", ""), *extra]:
        if user_text or answer:
            messages = [
                *messages,
                {"role": "assistant", "content": answer},
                {"role": "user", "content": user_text},
            ]
        body = {"model": "m", "messages": messages}
        try:
            text_, _ = tok.render_chat(body)
        except TokenizeError:
            return  # the fixture template refuses some shapes (e.g. empty system content)
        ids, _ = tok.chat_ids(body)
        assert ids == _scratch(tok, text_)


@FIXTURE_SETTINGS
@given(convo=metaspace_conversations(), more=st.lists(text, min_size=1, max_size=3))
def test_metaspace_first_prepend_scheme_is_safe(
    model_dirs: dict[str, Path], convo: list[dict[str, Any]], more: list[str]
) -> None:
    """The Metaspace pre-tokenizer prefixes only the piece at offset 0 ("first"); cuts at
    anchors must not change that."""
    tok = _shared(model_dirs["metaspace"])
    messages = list(convo)
    for t in more:
        body = {"model": "m", "messages": messages}
        text_, _ = tok.render_chat(body)
        assert tok.chat_ids(body)[0] == _scratch(tok, text_)
        messages = [*messages, {"role": "user", "content": t}]


@FIXTURE_SETTINGS
@given(
    kind=st.sampled_from(["chatml", "llama3", "sim"]),
    convo=conversations(roles=("user", "assistant")),
    answer=text,
    next_user=text,
)
def test_a_remembered_answer_keeps_the_next_turn_exact(
    model_dirs: dict[str, Path], kind: str, convo: list[dict[str, Any]], answer: str, next_user: str
) -> None:
    """`remember_answer` (any answer text, special-token look-alikes included) never changes
    the next turn's ids: they equal a full tokenization."""
    tok = _shared(SIM_MODEL if kind == "sim" else model_dirs[kind])
    if convo[-1]["role"] != "user":
        convo = [*convo, {"role": "user", "content": "q"}]
    body = {"model": "m", "messages": convo}
    nxt = {
        "model": "m",
        "messages": [
            *convo,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": next_user},
        ],
    }
    try:
        tok.remember_answer(body, answer)
        text_, _ = tok.render_chat(nxt)
    except TokenizeError:
        return  # the fixture template refuses some shapes (e.g. empty system content)
    assert tok.chat_ids(nxt)[0] == _scratch(tok, text_)


def test_a_remembered_answer_is_not_encoded_again(model_dirs: dict[str, Path]) -> None:
    for model_dir in (model_dirs["chatml"], model_dirs["llama3"], SIM_MODEL):
        tok = _local(model_dir)
        convo = [
            {"role": "system", "content": "You are helpful. " * 20},
            {"role": "user", "content": "question " * 30},
        ]
        answer = "a long answer " * 60
        tok.chat_ids({"model": "m", "messages": convo})
        assert tok.remember_answer({"model": "m", "messages": convo}, answer) > 0
        new = "next question " * 5
        nxt = [*convo, {"role": "assistant", "content": answer}, {"role": "user", "content": new}]
        ids, stats = tok.chat_ids({"model": "m", "messages": nxt})
        assert stats.cache_hit
        assert ids == _scratch(tok, tok.render_chat({"model": "m", "messages": nxt})[0])
        # the new message and the markers around it: far less than the answer itself
        assert stats.encoded_tokens < len(tok.encoder.encode(answer)) / 4, model_dir
        # nothing new to remember for the same answer again
        assert tok.remember_answer({"model": "m", "messages": convo}, answer) == 0


def test_remember_answer_refuses_what_it_cannot_use(model_dirs: dict[str, Path]) -> None:
    tok = _local(model_dirs["chatml"])
    convo = [{"role": "user", "content": "q " * 40}]
    assert tok.remember_answer({"model": "m", "messages": convo}, "") == 0
    assert tok.remember_answer({"model": "m", "messages": "x"}, "a") == 0
    cont = {"model": "m", "messages": convo, "continue_final_message": True}
    assert tok.remember_answer(cont, "a " * 40) == 0
    assert tok.cache.stats().entries == 0


SPECIALS = ["<|im_start|>", "<|im_end|>", "<s>", "</s>", "<|eot_id|>", "<tool_call>", "<think>"]
noisy = st.lists(
    st.one_of(
        st.sampled_from(SPECIALS),
        st.sampled_from(["<|im_", "start|>", "<", "|>", "s>", " ", "\n", "  ", "x", "é"]),
        st.text(max_size=5),
    ),
    max_size=40,
).map("".join)


@settings(
    max_examples=300 * SCALE,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    kind=st.sampled_from(["chatml", "metaspace"]),
    first=noisy,
    rest=st.lists(noisy, min_size=1, max_size=4),
)
def test_any_text_extended_any_way(
    model_dirs: dict[str, Path], kind: str, first: str, rest: list[str]
) -> None:
    """Adversarial: arbitrary text (broken special tokens, whitespace runs, unicode) extended by
    arbitrary text, tokenized through the cache each time, always equals from scratch."""
    tok = _shared(model_dirs[kind])
    current = first
    for piece in ["", *rest]:
        current += piece
        ids, _ = tok.text_ids(current, add_special_tokens=False) if current else ([], None)
        assert ids == (_scratch(tok, current) if current else [])


def test_history_is_not_retokenized(model_dirs: dict[str, Path]) -> None:
    tok = _local(model_dirs["chatml"])
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are helpful. " * 50}]
    encoded = []
    for turn in range(6):
        messages = [*messages, {"role": "user", "content": f"question {turn} " * 40}]
        ids, stats = tok.chat_ids({"model": "m", "messages": messages})
        encoded.append(stats.encoded_tokens)
        if turn:
            assert stats.cache_hit
            # only the new turn (plus the last turn's generation prompt) is encoded
            assert stats.encoded_tokens < len(ids) / 2
        messages = [*messages, {"role": "assistant", "content": f"answer {turn} " * 40}]
    assert max(encoded[1:]) < encoded[0] * 2


@pytest.mark.parametrize("kind", ["chatml", "llama3", "sim"])
def test_a_new_conversation_reuses_a_system_prompt_seen_in_another(
    model_dirs: dict[str, Path], kind: str
) -> None:
    """First turns of different conversations that open with the same system prompt: the
    second one takes the prompt's ids from the cache and encodes only its own message."""
    tok = _local(SIM_MODEL if kind == "sim" else model_dirs[kind])
    system = {"role": "system", "content": "You are a careful coding agent. Tools: " * 60}
    first = [system, {"role": "user", "content": "open the file main.py " * 5}]
    _, stats_a = tok.chat_ids({"model": "m", "messages": first})
    assert not stats_a.cache_hit
    other = [system, {"role": "user", "content": "list every test that fails " * 5}]
    text_b, _ = tok.render_chat({"model": "m", "messages": other})
    ids_b, stats_b = tok.chat_ids({"model": "m", "messages": other})
    assert ids_b == _scratch(tok, text_b)
    assert stats_b.cache_hit
    assert stats_b.encoded_tokens < len(ids_b) / 4  # the system prompt was not encoded again
    assert stats_b.reused_tokens > len(_scratch(tok, system["content"])) - 8


def test_add_special_tokens_wraps_cached_ids(model_dirs: dict[str, Path]) -> None:
    tok = _local(model_dirs["metaspace"])
    base = "<s>[INST] hello [/INST] answer </s>"
    for n in range(1, 5):
        t = base * n
        ids, _ = tok.text_ids(t, add_special_tokens=True)
        assert ids == tok.encoder.encode(t, add_special_tokens=True)
        assert ids[0] == tok.encoder.encode("<s>")[0]


# ---- anchors: the rules that make a cut exact ----------------------------------------------


def _tok_with(added: list[AddedToken]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import trainers

    tok.train_from_iterator(
        ["hello world <a> <ab> text", "more text here"] * 5,
        trainers.BpeTrainer(
            vocab_size=300,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.add_tokens(added)
    return tok


def test_anchor_rules() -> None:
    tok = _tok_with(
        [
            AddedToken("<a>", special=True, normalized=False),
            # a longer token sharing the prefix, itself no anchor (rstrip)
            AddedToken("<a>b", special=True, normalized=False, rstrip=True),
            # overlaps "<a>" from the left, itself no anchor (single_word)
            AddedToken("x<a", special=True, normalized=False, single_word=True),
            AddedToken("<ls>", special=True, normalized=False, lstrip=True),  # never an anchor
            AddedToken(" <sp>", special=True, normalized=False),  # starts with whitespace
        ]
    )
    enc = TextEncoder(tok)
    # a plain occurrence is a cut
    assert enc.last_anchor("hello <a> world", 0, 20) == 6
    # the longest match at the cut is another (non-anchor) token -> not a cut
    assert enc.last_anchor("hello <a>b world", 0, 20) is None
    assert enc.last_anchor("hello <a>c world", 0, 20) == 6
    # a token starting before the cut spans it -> not a cut
    assert enc.last_anchor("hellox<a> world", 0, 20) is None
    # lstrip and whitespace-edged tokens are never anchors
    assert enc.last_anchor("hello <ls> x", 0, 20) is None
    assert enc.last_anchor("hello <sp> x", 0, 20) is None
    # cache anchors stay clear of the end (a later character could extend the match)
    t = "hello <a>"
    assert enc.last_anchor(t, 0, len(t)) == 6
    assert enc.cache_anchor(t, 0) is None
    # the search respects the lower bound and finds the last of many
    many = "<a> x " * 2000
    assert enc.last_anchor(many, 0, len(many)) == len(many) - 6
    assert enc.last_anchor(many, len(many) - 3, len(many)) is None


@settings(max_examples=300 * SCALE, deadline=None)
@given(
    first=st.lists(
        st.sampled_from(["<a>", "<a>b", "x<a", "x", " ", "<", "a>", "b", "<ls>", "  "]), max_size=30
    ).map("".join),
    more=st.lists(
        st.lists(
            st.sampled_from(["<a>", "<a>b", "x<a", "x", " ", "<", "a>", "b", "<ls>"]), max_size=10
        ).map("".join),
        min_size=1,
        max_size=4,
    ),
)
def test_overlapping_added_tokens_never_break_cached_ids(first: str, more: list[str]) -> None:
    tok = _tok_with(
        [
            AddedToken("<a>", special=True, normalized=False),
            AddedToken("<a>b", special=True, normalized=False),
            AddedToken("x<a", special=True, normalized=False),
            AddedToken("<ls>", special=True, normalized=False, lstrip=True, rstrip=True),
        ]
    )
    spec = TokenizerSpec("local", path="unused")
    from kvroute.router.tokenize.model_dir import ModelFiles

    local = LocalTokenizer(spec, ModelFiles(tok, {}, {}), cache=PrefixCache(64, 1 << 22))
    current = first
    for piece in ["", *more]:
        current += piece
        if not current:
            continue
        ids, _ = local.text_ids(current, add_special_tokens=False)
        assert ids == local.encoder.encode(current)


def test_special_token_wrap_is_measured() -> None:
    tok = _tok_with([AddedToken("[CLS]", special=True), AddedToken("[SEP]", special=True)])
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    enc = TextEncoder(tok)
    ids = enc.encode("hello world")
    assert enc.add_special(ids, "hello world") == enc.encode("hello world", add_special_tokens=True)
    assert enc.add_special(ids, "hello world")[0] == cls


# ---- the cache itself ----------------------------------------------------------------------


def test_chunk_digests_commit_to_the_prefix() -> None:
    a = "x" * (3 * CHUNK_CHARS + 5)
    b = a[: 2 * CHUNK_CHARS] + "y" + a[2 * CHUNK_CHARS + 1 :]
    da, db = chunk_digests(a), chunk_digests(b)
    assert len(da) == 4
    assert da[:3] == db[:3] and da[3] != db[3]
    assert chunk_digests(a, seed=1)[1] != da[1]


def _insert(cache: PrefixCache, text_: str, anchor: int, n_ids: int, seed: int = 0) -> None:
    cache.insert(text_, cache.digests(text_, seed), list(range(n_ids)), [(anchor, n_ids)], 4)


def test_lookup_returns_the_longest_matching_prefix() -> None:
    cache = PrefixCache(100, 1 << 20)
    base = "".join(chr(65 + i % 26) for i in range(2000))
    _insert(cache, base, 300, 10)
    _insert(cache, base, 1500, 50)
    _insert(cache, base[:1000] + "Z" * 1000, 1800, 70)  # diverges at 1000
    hit = cache.lookup(base + "more", cache.digests(base + "more"))
    assert hit is not None and hit.anchor == 1500 and list(hit.ids) == list(range(50))
    diverged = base[:1200] + "Q" * 900
    hit = cache.lookup(diverged, cache.digests(diverged))
    assert hit is not None and hit.anchor == 300
    # the tail after the last chunk boundary is compared too, through the guard region
    for changed in (1499, 1500, 1503):
        near = base[:changed] + "!" + base[changed + 1 :]
        hit = cache.lookup(near, cache.digests(near))
        assert hit is not None and hit.anchor == 300, changed
    near = base[:1504] + "!" + base[1505:]
    hit = cache.lookup(near, cache.digests(near))
    assert hit is not None and hit.anchor == 1500
    # a text that ends inside the guard region does not match it
    short = base[:1502]
    hit = cache.lookup(short, cache.digests(short))
    assert hit is not None and hit.anchor == 300
    # other seeds (other tokenizers) never match
    assert cache.lookup(base, cache.digests(base, seed=7)) is None


def test_entry_bound_evicts_least_recently_used() -> None:
    cache = PrefixCache(3, 1 << 20)
    texts = [f"{i}" * 600 for i in range(4)]
    for t in texts[:3]:
        _insert(cache, t, 500, 5)
    assert cache.lookup(texts[0], cache.digests(texts[0])) is not None  # 0 is now recent
    _insert(cache, texts[3], 500, 5)
    stats = cache.stats()
    assert stats.entries == 3 and stats.evictions == 1
    assert cache.lookup(texts[1], cache.digests(texts[1])) is None  # the LRU one went
    for i in (0, 2, 3):
        assert cache.lookup(texts[i], cache.digests(texts[i])) is not None


def test_byte_bound_holds_exactly() -> None:
    one = 4 * 1000 + 4 * (504 - 256) + 200  # ids + tail + overhead of one entry below
    cache = PrefixCache(1000, 3 * one)
    for i in range(10):
        t = f"{i:03d}" * 300
        _insert(cache, t, 500, 1000)
        assert cache.stats().bytes <= 3 * one
    assert cache.stats().entries == 3
    # an entry larger than the whole budget is not stored (and evicts nothing)
    _insert(cache, "z" * 600, 500, 10**6)
    assert cache.stats().entries == 3


def test_zero_budget_stores_nothing(model_dirs: dict[str, Path]) -> None:
    tok = _local(model_dirs["chatml"], PrefixCache(0, 0))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi " * 100}]}
    ids, _ = tok.chat_ids(body)
    ids2, stats2 = tok.chat_ids(body)
    assert ids == ids2 and not stats2.cache_hit and tok.cache.stats().entries == 0


def test_reinserting_the_same_prefix_keeps_one_entry() -> None:
    cache = PrefixCache(10, 1 << 20)
    for _ in range(5):
        _insert(cache, "a" * 700, 600, 20)
    assert cache.stats().entries == 1


@pytest.mark.parametrize("bad", [-1])
def test_negative_bounds_are_refused(bad: int) -> None:
    with pytest.raises(ValueError):
        PrefixCache(bad, 10)


def test_verification_turns_the_cache_off_on_a_mismatch(model_dirs: dict[str, Path]) -> None:
    """If cached ids ever differed from a full tokenization, the model stops using the cache."""
    called = []
    files_tok = _local(model_dirs["chatml"])
    tok = LocalTokenizer(
        files_tok.spec,
        __import__("kvroute.router.tokenize.model_dir", fromlist=["load_model_dir"]).load_model_dir(
            model_dirs["chatml"]
        ),
        cache=PrefixCache(64, 1 << 24),
        verify_every=1,
        on_mismatch=lambda: called.append(1),
    )
    messages = [{"role": "user", "content": "hello " * 50}]
    tok.chat_ids({"model": "m", "messages": messages})
    # corrupt the cache: every stored id becomes 0
    for record in tok.cache._lru.values():
        for i in range(len(record.ids)):
            record.ids[i] = 0
    messages = [*messages, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    body = {"model": "m", "messages": messages}
    ids, stats = tok.chat_ids(body)
    text_, _ = tok.render_chat(body)
    assert stats.cache_hit
    assert ids == tok.encoder.encode(text_)  # the verified (fresh) ids are returned
    assert called == [1] and not tok.cache_enabled and tok.cache.stats().entries == 0


# ---- checkpoints: a text that departs from a cached one before its end ----------------------


def test_a_record_answers_at_each_of_its_marks() -> None:
    cache = PrefixCache(100, 1 << 20)
    base = "".join(chr(65 + i % 26) for i in range(3000))
    ids = list(range(90))
    cache.insert(base, cache.digests(base), ids, [(700, 20), (1600, 50), (2900, 90)], 4)
    assert cache.stats().entries == 1
    for depart, anchor, n in ((2950, 2900, 90), (2000, 1600, 50), (1000, 700, 20)):
        departed = base[:depart] + "!" * 600
        hit = cache.lookup(departed, cache.digests(departed))
        assert hit is not None and hit.anchor == anchor and list(hit.ids) == ids[:n], depart
    departed = base[:500] + "!" * 600
    assert cache.lookup(departed, cache.digests(departed)) is None


def test_evicting_a_record_drops_every_mark_but_those_taken_over() -> None:
    cache = PrefixCache(1, 1 << 20)
    a = "".join(chr(65 + i % 26) for i in range(3000))
    cache.insert(a, cache.digests(a), list(range(90)), [(700, 20), (2900, 90)], 4)
    # b shares a's text through the first mark's guard region and files the same mark
    b = a[:1200] + "?" * 1800
    cache.insert(b, cache.digests(b), list(range(60)), [(700, 20), (2800, 60)], 4)
    stats = cache.stats()
    assert stats.entries == 1 and stats.evictions == 1  # a went, all its marks with it
    hit = cache.lookup(a + "x", cache.digests(a + "x"))  # b's mark at 700
    assert hit is not None and hit.anchor == 700 and list(hit.ids) == list(range(20))
    assert sum(len(bucket) for bucket in cache._buckets.values()) == 2


def test_marks_are_counted_in_the_byte_bound() -> None:
    text_ = "".join(chr(65 + i % 26) for i in range(3000))
    one = PrefixCache(10, 1 << 20)
    one.insert(text_, one.digests(text_), list(range(90)), [(2900, 90)], 4)
    three = PrefixCache(10, 1 << 20)
    three.insert(
        text_, three.digests(text_), list(range(90)), [(700, 20), (1600, 50), (2900, 90)], 4
    )
    assert three.stats().bytes > one.stats().bytes
    tight = PrefixCache(10, one.stats().bytes)
    tight.insert(
        text_, tight.digests(text_), list(range(90)), [(700, 20), (1600, 50), (2900, 90)], 4
    )
    assert tight.stats().entries == 0  # larger than the whole budget: not stored


@pytest.mark.parametrize(
    "marks, n_ids",
    [
        ([], 0),
        ([(900, 10), (700, 20)], 20),
        ([(700, 20), (900, 10)], 20),
        ([(700, 20)], 21),
        ([(2999, 20)], 20),
    ],
)
def test_bad_marks_are_refused(marks: list[tuple[int, int]], n_ids: int) -> None:
    cache = PrefixCache(10, 1 << 20)
    text_ = "a" * 3000
    with pytest.raises(ValueError):
        cache.insert(text_, cache.digests(text_), list(range(n_ids)), marks, 4)


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(
        rng.choice(["cache", "router", "worker", "12,345", "tokens;", "é"]) for _ in range(n)
    )


@pytest.mark.parametrize("kind", ["chatml", "llama3", "metaspace", "sim"])
def test_a_prompt_departing_before_the_earlier_ones_end_reuses_what_came_before(
    model_dirs: dict[str, Path], kind: str
) -> None:
    """A completions-style text whose last ~2,000 characters differ from a cached one (its
    last block rewritten): exact ids, and only about the differing text is encoded."""
    tok = _local(SIM_MODEL if kind == "sim" else model_dirs[kind])
    shared = _words(1, 4000)
    earlier = shared + " " + _words(2, 300)
    later = shared + " " + _words(3, 900)
    tok.text_ids(earlier, add_special_tokens=False)
    ids, stats = tok.text_ids(later, add_special_tokens=False)
    assert ids == _scratch(tok, later)
    assert stats.cache_hit
    departed = len(tok.encoder.encode(later)) - len(tok.encoder.encode(shared))
    # the text after the departure, plus at most the distance back to a checkpoint again
    assert stats.encoded_tokens <= 2 * departed + 64, (stats, departed)


@FIXTURE_SETTINGS
@given(
    kind=st.sampled_from(["chatml", "metaspace", "sim"]),
    first=noisy,
    keep=st.floats(min_value=0.0, max_value=1.0),
    rest=noisy,
)
def test_any_text_departing_anywhere_from_a_cached_one(
    model_dirs: dict[str, Path], kind: str, first: str, keep: float, rest: str
) -> None:
    """Adversarial: a text that keeps any share of a cached text and continues differently
    always tokenizes, through the cache, to the from-scratch ids."""
    tok = _shared(SIM_MODEL if kind == "sim" else model_dirs[kind])
    earlier = (first + " ") * (1 + 6000 // (len(first) + 1))  # past a few checkpoints
    later = earlier[: int(len(earlier) * keep)] + rest
    for t in (earlier, later):
        if t:
            assert tok.text_ids(t, add_special_tokens=False)[0] == _scratch(tok, t)
