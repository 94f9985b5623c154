"""Deterministic prompts for the reliability tests: documents that share prefixes, as a
retrieval or multi-turn workload does, so caches hold overlapping content."""

from __future__ import annotations

import random

from bench.words import text


def documents(seed: int, n: int, words: int = 200) -> list[str]:
    rng = random.Random(seed)
    return [text(rng, words) for _ in range(n)]


def shared_prefix_prompts(seed: int, docs: int, per_doc: int, words: int = 200) -> list[str]:
    """`docs` documents, each followed by `per_doc` different questions."""
    rng = random.Random(seed + 1)
    out = []
    for doc in documents(seed, docs, words):
        for _ in range(per_doc):
            out.append(f"{doc}\nQuestion: {text(rng, 12)}?")
    return out
