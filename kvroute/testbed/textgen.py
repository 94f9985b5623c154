"""Deterministic synthetic text of a wanted token length.

A :class:`TokenSpace` turns a key (any tuple of strings and ints) and a token count into
text. Equal keys give equal text, and the text for ``n`` tokens is a prefix of the text for
``m > n`` tokens of the same key, so a trace can share prefixes on purpose (a system prompt,
a Mooncake hash id) and nowhere else.

With a Hugging Face ``tokenizer.json`` (the simulated engine's), the words are chosen from
the tokenizer's own vocabulary such that each ``" word"`` is exactly one token, so the text
for ``n`` tokens tokenizes to ``n`` tokens (checked on the word list when loaded). Without
one, a built-in list of short words is used and the length is approximate (one word is
about one to two tokens for common BPE tokenizers).
"""

from __future__ import annotations

import random
import string
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

# Only plain ASCII words and numbers: they survive every chat template and detokenisation.
_MIN_WORD, _MAX_WORD = 1, 12
_MAX_WORDS = 4096
_MIN_USABLE = 256
_WORD_CHARS = frozenset(string.ascii_letters + string.digits)


def _fallback_words() -> list[str]:
    """A fixed list of pronounceable words (no tokenizer available)."""
    consonants = "bdfgklmnprstvz"
    vowels = "aeiou"
    words = []
    for c1 in consonants:
        for v1 in vowels:
            for c2 in consonants:
                for v2 in vowels:
                    words.append(c1 + v1 + c2 + v2)
    rng = random.Random("kvroute-fallback-words")
    rng.shuffle(words)
    return words[:_MAX_WORDS]


def _load_tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def _single_token_words(tok: Any) -> list[str]:
    """Words ``w`` such that ``" " + w`` is one token on its own and inside a run of words."""
    vocab: dict[str, int] = tok.get_vocab()
    candidates = []
    for token_id in sorted(vocab.values()):
        text = tok.decode([token_id])
        if not text.startswith(" "):
            continue
        word = text[1:]
        if (
            _MIN_WORD <= len(word) <= _MAX_WORD
            and all(ch in _WORD_CHARS for ch in word)
            and tok.encode(text, add_special_tokens=False).ids == [token_id]
        ):
            candidates.append(word)
    candidates = sorted(set(candidates))
    rng = random.Random("kvroute-token-words")
    rng.shuffle(candidates)
    return candidates[:_MAX_WORDS]


class TokenSpace:
    """Makes text of a wanted token length from a key (see the module docstring)."""

    def __init__(self, words: Sequence[str], tokenizer: Any = None, source: str = "") -> None:
        if len(words) < 2:
            raise ValueError("need at least two words")
        self._words = list(words)
        self._tokenizer = tokenizer
        self.source = source

    @classmethod
    def fallback(cls) -> TokenSpace:
        return cls(_fallback_words(), None, "built-in words (approximate lengths)")

    @classmethod
    def from_tokenizer_file(cls, path: str | Path) -> TokenSpace:
        """Build from a ``tokenizer.json``; falls back to built-in words if it has too few."""
        tok = _load_tokenizer(Path(path))
        words = _single_token_words(tok)
        if len(words) < _MIN_USABLE:
            return cls.fallback()
        space = cls(words, tok, str(path))
        # The whole point: a run of n words must be n tokens. Check it once, loudly.
        probe = space.text(("self-check",), 200)
        n = space.count_tokens(probe)
        if n is not None and abs(n - 200) > 2:
            raise ValueError(f"{path}: 200 words tokenised to {n} tokens; not additive")
        return space

    @classmethod
    def discover(cls, hint: str | Path | None = None) -> TokenSpace:
        """The sim's tokenizer if it can be found (``hint`` = file or model directory)."""
        for path in _tokenizer_candidates(hint):
            if path.is_file():
                return cls.from_tokenizer_file(path)
        return cls.fallback()

    @property
    def exact(self) -> bool:
        """True when lengths are exact under a real tokenizer."""
        return self._tokenizer is not None

    def words(self, key: Hashable, n: int) -> list[str]:
        """The first ``n`` words of the key's word stream."""
        rng = random.Random(repr(key))
        k = len(self._words)
        return [self._words[rng.randrange(k)] for _ in range(max(0, n))]

    def text(self, key: Hashable, n_tokens: int) -> str:
        """Text of about ``n_tokens`` tokens, each word with a leading space."""
        return "".join(" " + w for w in self.words(key, n_tokens))

    def content(self, key: Hashable, n_tokens: int) -> str:
        """Like :meth:`text` without the leading space (for chat message content)."""
        return self.text(key, n_tokens)[1:]

    def count_tokens(self, text: str) -> int | None:
        """Token count under the real tokenizer, or None without one."""
        if self._tokenizer is None:
            return None
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)


def _tokenizer_candidates(hint: str | Path | None) -> list[Path]:
    out: list[Path] = []
    if hint is not None:
        p = Path(hint)
        out.append(p / "tokenizer.json" if p.is_dir() else p)
    # The simulated engine ships its model directory inside the sim package.
    root = Path(__file__).resolve().parent.parent / "sim" / "model"
    if root.is_dir():
        out.extend(sorted(root.rglob("tokenizer.json")))
    return out
