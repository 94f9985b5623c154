"""Deterministic "model output": which tokens a request generates, from a seed.

The same prompt (and seed) always produces the same answer, so multi-turn conversations and
repeated requests behave reproducibly. Output tokens are drawn from the tokenizer's word-like
tokens, so responses decode to readable (if meaningless) text. Unless `ignore_eos` is set, the
answer ends with EOS after a natural length drawn from the seed (8 to 200 tokens), like a
model that finishes its sentence; `max_tokens` cuts it earlier.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

from kvroute.sim.tokenizer import SimTokenizer


def word_token_ids(tok: SimTokenizer) -> list[int]:
    """Vocabulary entries that decode to a space followed by a word (sorted, stable)."""
    ids = []
    for token_id in range(tok.vocab_size):
        if token_id in tok.special_ids:
            continue
        piece = tok.id_to_token(token_id) or ""
        if piece.startswith("\u0120") and piece[1:].isalpha() and len(piece) >= 4:
            ids.append(token_id)
    return ids or [i for i in range(tok.vocab_size) if i not in tok.special_ids]


class OutputStream:
    """The tokens one request will generate, produced one at a time."""

    def __init__(
        self,
        prompt_ids: Sequence[int],
        vocab: Sequence[int],
        eos_id: int,
        seed: int | None = None,
        ignore_eos: bool = False,
        engine_seed: int = 0,
    ) -> None:
        material = repr((engine_seed, seed, list(prompt_ids))).encode()
        self._rng = random.Random(hashlib.sha256(material).digest())
        self._vocab = vocab
        self._eos = eos_id
        self.natural_length = self._rng.randint(8, 200)
        self._ignore_eos = ignore_eos
        self.count = 0

    def next_token(self) -> int:
        """The next generated token (EOS once the natural length is reached)."""
        self.count += 1
        if not self._ignore_eos and self.count >= self.natural_length:
            return self._eos
        return self._vocab[self._rng.randrange(len(self._vocab))]
