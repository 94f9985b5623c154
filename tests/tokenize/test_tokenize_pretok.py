"""Pre-tokenizer cuts: plain text is cut only where the tokenizer's own pipeline always splits,
so cached prefix + encoded rest == a full encode, for every supported pipeline, on random and
adversarial text; pipelines not proven safe are refused (and plain text encoded whole)."""

from __future__ import annotations

import json
import os
import random
import time
import unicodedata

import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pretok_pipelines import SUPPORTED, added_edges, built, plain_text, qwen2_ranks
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from kvroute.router.tokenize.chat_request import NotExact
from kvroute.router.tokenize.encoder import TextEncoder
from kvroute.router.tokenize.local import LocalTokenizer
from kvroute.router.tokenize.model_dir import ModelFiles
from kvroute.router.tokenize.prefix_cache import PrefixCache, tenant_key
from kvroute.router.tokenize.pretok import (
    KNOWN_SPLITS,
    LLAMA3_SPLIT,
    QWEN2_SPLIT,
    cut_pattern,
    cut_rule,
)
from kvroute.router.tokenize.spec import TokenizerSpec
from kvroute.sim.model import MODEL_DIR

SCALE = int(os.environ.get("KVROUTE_TOKENIZE_SCALE", "1"))
PROPERTY = settings(
    max_examples=60 * SCALE,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
NAMES = sorted(SUPPORTED)


def _encoder(name: str) -> TextEncoder:
    if name == "sim":
        return TextEncoder(Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")))
    return TextEncoder(built(name))


_ENCODERS: dict[str, TextEncoder] = {}


def encoder(name: str) -> TextEncoder:
    if name not in _ENCODERS:
        _ENCODERS[name] = _encoder(name)
    return _ENCODERS[name]


def local(name: str, cache: PrefixCache | None = None) -> LocalTokenizer:
    tok = encoder(name)._tok  # the same loaded tokenizer: cheap
    spec = TokenizerSpec("local", path="unused")
    return LocalTokenizer(spec, ModelFiles(tok, {}, {}), cache=cache or PrefixCache(256, 1 << 26))


def all_cuts(enc: TextEncoder, text: str) -> list[int]:
    cuts = []
    j = enc.last_anchor(text, 0, len(text))
    while j is not None:
        cuts.append(j)
        j = enc.last_anchor(text, 0, j - 1)
    return cuts


def _words(rng: random.Random, n: int) -> str:
    vocab = ["router", "cache", "worker", "prefix", "It's", "3.14", "2024", "—", "東京", "naïve"]
    return " ".join(rng.choice(vocab) for _ in range(n))


# ---- every cut is exact ---------------------------------------------------------------------


@pytest.mark.parametrize("name", [*NAMES, "sim"])
@PROPERTY
@given(text=plain_text)
def test_every_cut_splits_the_ids_exactly(name: str, text: str) -> None:
    """For each cut the encoder accepts in a text: ids(text[:cut]) + ids(text[cut:]) ==
    ids(text), with and without special tokens around."""
    enc = encoder(name)
    whole = enc.encode(text)
    for cut in all_cuts(enc, text):
        assert enc.encode(text[:cut]) + enc.encode(text[cut:]) == whole, (name, text, cut)


@settings(max_examples=300 * SCALE, deadline=None)
@given(text=added_edges)
def test_cuts_next_to_added_tokens_are_exact(text: str) -> None:
    """Added tokens that eat whitespace (lstrip, rstrip), match whole words only, or hold a
    space, packed between spaces: every accepted cut is still exact."""
    enc = encoder("gpt2_prefix_space")
    whole = enc.encode(text)
    for cut in all_cuts(enc, text):
        assert enc.encode(text[:cut]) + enc.encode(text[cut:]) == whole, (text, cut)


@pytest.mark.parametrize("name", [*NAMES, "sim"])
@PROPERTY
@given(text=plain_text, rest=plain_text)
def test_a_cut_depends_only_on_its_guard_region(name: str, text: str, rest: str) -> None:
    """A cut found in one text stays exact in any text that shares the text up to the end of
    its guard region, whatever follows (which is what lets the cache reuse it)."""
    enc = encoder(name)
    cut = enc.cache_anchor(text, 0)
    if cut is None:
        return
    other = text[: cut + enc.guard_chars] + rest
    assert enc.encode(other[:cut]) + enc.encode(other[cut:]) == enc.encode(other)


_SHARED: dict[str, LocalTokenizer] = {}


@pytest.mark.parametrize("name", [*NAMES, "sim"])
@PROPERTY
@given(
    first=plain_text,
    turns=st.lists(plain_text, min_size=1, max_size=4),
    salt=st.sampled_from(["", "tenant-a", "tenant-b"]),
    add_special=st.booleans(),
)
def test_text_extended_turn_by_turn_equals_a_full_encode(
    name: str, first: str, turns: list[str], salt: str, add_special: bool
) -> None:
    """Through the prefix cache (one per pipeline, shared by all examples and tenants): a text
    extended turn by turn always gets the ids of a full encode."""
    if name not in _SHARED:
        _SHARED[name] = local(name, PrefixCache(512, 1 << 24))
    tok = _SHARED[name]
    tenant = tenant_key("", salt)
    current = first
    for piece in ["", *turns]:
        current += piece
        expected = tok.encoder.encode(current, add_special_tokens=add_special)
        if not expected:  # e.g. only characters a normalizer drops: refused either way
            with pytest.raises(NotExact):
                tok.text_ids(current, add_special, tenant=tenant)
            continue
        ids, _ = tok.text_ids(current, add_special, tenant=tenant)
        assert ids == expected


# ---- what the cuts save ---------------------------------------------------------------------


@pytest.mark.parametrize("name", [*NAMES, "sim"])
def test_an_extended_plain_prompt_encodes_only_its_new_text(name: str) -> None:
    """A long prompt without added tokens, then the same prompt with more text: the second
    encode reuses the first's ids up to a cut near its end and encodes only what is new."""
    tok = local(name)
    rng = random.Random(7)
    prompt = _words(rng, 3000)
    longer = prompt + " " + _words(rng, 150)
    first, stats = tok.text_ids(prompt, True)
    assert not stats.cache_hit
    ids, stats = tok.text_ids(longer, True)
    assert ids == tok.encoder.encode(longer, add_special_tokens=True)
    assert stats.cache_hit
    new_tokens = len(ids) - len(first)
    # what was new, and the few tokens of the old text within the guard region of its cut
    guard = tok.encoder.guard_chars
    assert stats.encoded_tokens <= new_tokens + guard, (stats, new_tokens)
    assert stats.reused_tokens >= len(first) - guard


def test_tenants_never_share_plain_text_entries() -> None:
    tok = local("llama3")
    prompt = _words(random.Random(3), 800)
    a, b = tenant_key("", "salt-a"), tenant_key("lora-b", "")
    tok.text_ids(prompt, False, tenant=a)
    longer = prompt + " more words here"
    assert not tok.text_ids(longer, False, tenant=b)[1].cache_hit
    assert not tok.text_ids(longer, False, tenant=b"")[1].cache_hit
    ids, stats = tok.text_ids(longer + " and more", False, tenant=a)
    assert stats.cache_hit and ids == tok.encoder.encode(longer + " and more")


# ---- where cuts are not made ----------------------------------------------------------------


def test_cuts_keep_clear_of_added_tokens_and_whitespace_runs() -> None:
    enc = encoder("gpt2_prefix_space")  # <mask> eats whitespace on its left, <eat> on its right
    assert enc.last_anchor("hello world", 0, 11) == 5
    # `<mask>` would take the space before it, `<eat>` the one after it: no cut within reach
    assert all_cuts(enc, "hello there big <mask> world") == [5]
    assert enc.last_anchor("hello <eat> world", 0, 17) is None
    # only a single space between non-space characters: never inside a run
    assert all_cuts(enc, "a  b\t c \nd 12 345") == [13, 10]
    # no cut at a text's very end (its right neighbour is not known yet)
    assert enc.last_anchor("ab cd ", 0, 6) == 2


def test_no_cut_after_a_typed_metaspace_replacement() -> None:
    """'x▁ y': the replaced space after a typed '▁' could merge with it (the vocabulary has
    '▁▁'); such a cut would be wrong, so there is none."""
    enc = encoder("metaspace_one_word")
    text = "abc x▁ y▁ z q"
    cuts = all_cuts(enc, text)
    assert 6 not in cuts and 9 not in cuts and cuts
    tok = enc._tok
    naive = [m.start() for m in cut_pattern().finditer(text)]
    assert any(
        tok.encode(text[:c], add_special_tokens=False).ids
        + tok.encode(text[c:], add_special_tokens=False).ids
        != tok.encode(text, add_special_tokens=False).ids
        for c in naive
    ), "the rule guards against a real merge"


def _trained(
    pre: pre_tokenizers.PreTokenizer | None, normalizer: normalizers.Normalizer | None = None
) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre is not None:
        tok.pre_tokenizer = pre
    tok.train_from_iterator(
        ["hello world, the router caches prefixes", "more  text\there 12345"] * 5,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<unk>"],
            initial_alphabet=list("abcdefghijklmnopqrstuvwxyz ▁,\t0123456789"),
            show_progress=False,
        ),
    )
    return tok


def _legacy_llama2() -> Tokenizer:
    """Normalizer Prepend('▁') + Replace(' ', '▁'), no pre-tokenizer (legacy Llama-2 files):
    every piece would get its own '▁'."""
    return _trained(
        None,
        normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
    )


def _truncating() -> Tokenizer:
    tok = _trained(pre_tokenizers.ByteLevel())
    tok.enable_truncation(64)
    return tok


def _normalized_added() -> Tokenizer:
    tok = _trained(_split_llama3(), normalizers.NFC())
    tok.add_tokens([AddedToken("<x>", normalized=True)])
    return tok


def _split_llama3(behavior: str = "isolated") -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior=behavior),  # type: ignore[arg-type]
            pre_tokenizers.ByteLevel(use_regex=False),
        ]
    )


REFUSED = {
    "legacy Llama-2 normalizer": (_legacy_llama2, "normalizer Prepend"),
    "NFKC": (lambda: _trained(pre_tokenizers.ByteLevel(), normalizers.NFKC()), "NFKC"),
    "Lowercase": (lambda: _trained(pre_tokenizers.ByteLevel(), normalizers.Lowercase()), "Low"),
    "unknown regex": (
        lambda: _trained(pre_tokenizers.Split(Regex(r"\S+\s*"), behavior="isolated")),
        "pattern not known",
    ),
    "merged split": (lambda: _trained(_split_llama3("merged_with_previous")), "behaviour"),
    "ByteLevel without regex": (lambda: _trained(pre_tokenizers.ByteLevel(use_regex=False)), "By"),
    "Whitespace": (lambda: _trained(pre_tokenizers.Whitespace()), "Whitespace"),
    "no pre-tokenizer": (lambda: _trained(None), "no pre-tokenizer"),
    "later unknown step": (
        lambda: _trained(
            pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"), pre_tokenizers.Whitespace()]
            )
        ),
        "step Whitespace",
    ),
    "Metaspace one word, merges across": (
        lambda: _trained(pre_tokenizers.Metaspace(split=False)),
        "tokens holding a replacement",
    ),
    "truncation": (_truncating, "truncation"),
    "normalized added token": (_normalized_added, "normalised"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_pipelines_not_proven_safe_are_refused(case: str) -> None:
    build, why = REFUSED[case]
    tok = build()
    enc = TextEncoder(tok)
    assert enc.pretok_refusal is not None and why in enc.pretok_refusal, enc.pretok_refusal
    text = "hello world, the router caches prefixes " * 30
    assert enc.last_anchor(text, 0, len(text)) is None
    # and the prompt is encoded whole each time, as before
    lt = LocalTokenizer(
        TokenizerSpec("local", path="unused"),
        ModelFiles(tok, {}, {}),
        cache=PrefixCache(64, 1 << 22),
    )
    lt.text_ids(text, False)
    ids, stats = lt.text_ids(text + "more", False)
    assert not stats.cache_hit and ids == enc.encode(text + "more")


@pytest.mark.parametrize("case", ["legacy Llama-2 normalizer", "Metaspace one word, merges across"])
def test_refused_pipelines_would_really_break(case: str) -> None:
    """The refusals are not caution alone: cutting these at the same places changes the ids."""
    tok = REFUSED[case][0]()
    text = "hello world, the router caches prefixes more text here"
    whole = tok.encode(text, add_special_tokens=False).ids
    broken = [
        c
        for c in (m.start() for m in cut_pattern().finditer(text))
        if tok.encode(text[:c], add_special_tokens=False).ids
        + tok.encode(text[c:], add_special_tokens=False).ids
        != whole
    ]
    assert broken


def test_real_tokenizer_json_shapes_are_recognised() -> None:
    """The pipelines as written in published tokenizer.json files (normalizer, pre_tokenizer
    and model keys only)."""
    llama3 = {
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": LLAMA3_SPLIT},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": True,
                    "use_regex": False,
                },
            ],
        },
        "model": {"type": "BPE", "ignore_merges": True, "vocab": {}},
    }
    gpt2 = {
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": True,
        },
    }
    mistral = {
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Metaspace",
            "replacement": "▁",
            "prepend_scheme": "first",
            "split": False,
        },
        "model": {"type": "BPE", "vocab": {"▁the": 0, "▁▁": 1, "ing": 2, "<0x0A>": 3}},
    }
    for config in (llama3, gpt2, mistral):
        assert cut_rule(config).refusal is None, config
    qwen2 = json.loads(json.dumps(llama3))
    qwen2["normalizer"] = {"type": "NFC"}
    assert cut_rule(qwen2).refusal is None
    mistral["model"]["vocab"]["a▁b"] = 4  # type: ignore[index]
    assert cut_rule(mistral).refusal is not None


def test_pieces_are_encoded_on_the_calling_thread() -> None:
    """The pieces of one prompt are encoded on the calling thread: a batch of several would be
    spread over the tokenizer library's worker threads, whose waiting costs CPU beyond the
    encode (the router's CPU per request is what the prefix cache saves)."""
    enc = encoder("sim")
    pieces = [_words(random.Random(i), 4000) for i in range(4)]
    enc.encode_pieces(pieces)  # warm up
    thread0, process0 = time.thread_time(), time.process_time()
    got = enc.encode_pieces(pieces)
    thread, process = time.thread_time() - thread0, time.process_time() - process0
    assert got == [enc.encode(p) for p in pieces]
    assert thread >= 0.8 * process, (thread, process)


@pytest.mark.parametrize(
    "pre",
    [
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        *(
            pre_tokenizers.Split(Regex(pattern), behavior="isolated")
            for pattern in sorted(KNOWN_SPLITS)
        ),
    ],
    ids=["byte_level", *(f"split{i}" for i in range(len(KNOWN_SPLITS)))],
)
def test_every_non_space_character_around_a_cut_keeps_it_a_split(
    pre: pre_tokenizers.PreTokenizer,
) -> None:
    """Every code point of the BMP (and every 7th above it) left and right of a single space:
    wherever the cut rule accepts the space, the pre-tokenizer's regex puts a split right there
    (the rule's whitespace class is no smaller than the regex engine's)."""
    chars = [chr(c) for c in [*range(0x10000), *range(0x10000, 0x110000, 7)]]
    chars = [c for c in chars if not 0xD800 <= ord(c) <= 0xDFFF]
    text = " ".join(a + b for a, b in zip(chars, [*chars[1:], chars[0]], strict=True))
    starts = {start for _, (start, _) in pre.pre_tokenize_str(text)}
    missing = [i for i in (m.start() for m in cut_pattern().finditer(text)) if i not in starts]
    assert not missing, [text[i - 1 : i + 2] for i in missing[:5]]


def test_real_qwen2_vocabulary_matches_tiktoken() -> None:
    """The Qwen2 tokenizer built from the shipped ranks encodes as tiktoken does with them (on
    NFC text, which Qwen2's normalizer gives): the tests above ran on the real vocabulary."""
    enc = tiktoken.Encoding(
        "qwen2", pat_str=QWEN2_SPLIT, mergeable_ranks=qwen2_ranks(), special_tokens={}
    )
    tok = encoder("qwen2_real")
    assert tok.vocab_size > 151_000
    rng = random.Random(5)
    texts = [
        "Hello world, it's 12345 tokens!  \n\n def f(x):\n    return x",
        "Emojis 😀👍🏽 東京 naïve Zürich русский текст עברית",
        _words(rng, 2000),
        *("".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(60)) for _ in range(100)),
    ]
    for text in texts:
        text = unicodedata.normalize("NFC", text)
        assert tok.encode(text) == enc.encode_ordinary(text), text
