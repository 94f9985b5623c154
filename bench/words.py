"""Deterministic filler text for load and reliability runs: words drawn from a fixed list, so
the same seed gives the same documents (and the same cached prefixes) in every run."""

from __future__ import annotations

import random

WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
    "river",
    "stone",
    "cloud",
    "paper",
    "garden",
    "window",
    "silver",
    "orange",
    "market",
    "engine",
    "signal",
    "harbor",
    "lantern",
    "meadow",
]


def text(rng: random.Random, words: int) -> str:
    """`words` words drawn from WORDS with `rng`."""
    return " ".join(rng.choice(WORDS) for _ in range(words))
