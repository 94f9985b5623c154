"""Cuts inside plain text where a tokenizer's own pipeline always splits (pre-tokenizer cuts).

Prompts without added tokens (a completions prompt, a long user message) have no anchors
(`encoder`), so without these cuts they are tokenized whole every time. A `tokenizers`
pipeline normalises a section of text, pre-tokenizes it into words, and encodes each word on
its own: the model never merges across a word boundary. So where the first splitting step of
the pre-tokenizer always puts a boundary, and nothing before it looks across, the ids of the
two halves, concatenated, are the ids of the whole.

The cut used here: before a single space (U+0020) that has a non-whitespace character on each
side (`ws` as Python's `str.isspace`, a superset of the `\\s` the tokenizer's regex engine
uses). It is a boundary, and the two halves tokenize alone as in the whole, in these
pipelines, which are the only ones accepted (`cut_rule` says why it refuses any other):

- First splitting step a `Split` (behaviour Isolated, not inverted) with one of `KNOWN_SPLITS`
  (GPT-2's, the Llama-3/cl100k one, Qwen2's, Qwen3.5's, o200k's), or `ByteLevel` with
  `use_regex` (GPT-2's regex). In each, a space can only be the first character of a match or
  follow other whitespace; so no match holds a non-space character followed by the space, and a
  match starts at the space. The only lookahead, `\\s+(?!\\S)`, belongs to whitespace runs,
  which end before the non-space character on the left; no alternative looks behind. Digit,
  space and punctuation runs, whose splitting depends on their length, are never cut.
- `Metaspace` with `split` true (it splits before every replacement character, which the
  space becomes); with `split` false (one word: the model sees the whole text) only with a
  plain BPE none of whose tokens holds the replacement character after another character, so
  no token can span the cut. Never a cut after a replacement character typed into the text.
- Later steps see each word alone and split the two halves as they split the whole. Offset
  sensitive ones (ByteLevel `add_prefix_space`, Metaspace prepend schemes "first"/"always")
  prefix a word that does not start with a space: the half after a cut does.
- Normalizer none or NFC (a space is a starter that never composes with what precedes it, so
  NFC of the whole is NFC of the halves); others (e.g. the Prepend of legacy Llama-2 files,
  which prefixes every piece) are refused.

Added tokens are matched before all of this: `encoder` refuses a cut with an added token
occurrence within reach (lstrip/rstrip tokens eat neighbouring whitespace), and turns these
cuts off when an added token is matched on normalised text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

# The regexes of `Split` steps for which the module docstring's argument holds, as written in
# tokenizer.json files.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
KNOWN_SPLITS = frozenset({GPT2_SPLIT, LLAMA3_SPLIT, QWEN2_SPLIT, QWEN35_SPLIT, O200K_SPLIT})

# How many characters after a cut decide it (the space and the character after it).
CUT_REACH = 2


def cut_pattern(not_left: str = "") -> re.Pattern[str]:
    """Cut candidates: a single space between two non-whitespace characters, none of
    `not_left` on its left; the cut is the space's position. Python's \\s (str.isspace)
    covers every character the tokenizer's regex engine counts as whitespace."""
    return re.compile(rf"(?<=[^\s{re.escape(not_left)}]) (?=\S)")


Step = Mapping[str, Any]
# A step's verdict: (why it is refused or None, characters a cut must not have on its left)
Verdict = tuple[str | None, str]


@dataclass(frozen=True, slots=True)
class CutRule:
    """Where the pipeline always splits plain text: `pattern` finds cut candidates (a match's
    start is the cut); an `encoder` also keeps added tokens out of reach. `refusal` says why
    there are no cuts (pattern None)."""

    pattern: re.Pattern[str] | None
    refusal: str | None


def _normalizer_refusal(norm: Step | None) -> str | None:
    if norm is None:
        return None
    kind = norm.get("type")
    if kind == "NFC":
        return None
    if kind == "Sequence":
        for child in norm.get("normalizers") or []:
            if (why := _normalizer_refusal(child)) is not None:
                return why
        return None
    return f"normalizer {kind}"


def _split_first(step: Step, model: Step) -> Verdict:
    pattern = step.get("pattern") or {}
    if pattern.get("Regex") not in KNOWN_SPLITS:
        return "Split with a pattern not known to be safe", ""
    if step.get("behavior") != "Isolated" or step.get("invert"):
        return "Split with a behaviour other than Isolated", ""
    return None, ""


def _byte_level_first(step: Step, model: Step) -> Verdict:
    if not step.get("use_regex", True):
        return "ByteLevel without its regex splits nothing", ""
    return None, ""


def _metaspace_first(step: Step, model: Step) -> Verdict:
    replacement = str(step.get("replacement", "\u2581"))
    # a replacement character typed into the text, left of a cut, could merge with the
    # replaced space after it: never cut there
    if len(replacement) != 1:
        return "Metaspace with a replacement of other than one character", ""
    if step.get("split", True):
        return None, replacement
    # one word: the model sees the whole text, so its vocabulary must not span a cut
    if model.get("type") != "BPE" or model.get("dropout"):
        return "Metaspace without split, model other than BPE without dropout", ""
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return "Metaspace without split, BPE marking word starts or ends", ""
    across = re.compile(f"[^{re.escape(replacement)}]{re.escape(replacement)}")
    if any(across.search(token) for token in model.get("vocab") or {}):
        return "Metaspace without split, tokens holding a replacement after a character", ""
    return None, replacement


# The first splitting step: type -> its verdict (module docstring).
FIRST_STEPS: dict[str, Callable[[Step, Step], Verdict]] = {
    "Split": _split_first,
    "ByteLevel": _byte_level_first,
    "Metaspace": _metaspace_first,
}
# Steps that may follow it: they treat each word on its own, and any offset-sensitive
# prefixing they do is skipped for a word that starts with a space (module docstring).
LATER_STEPS = frozenset({"Split", "ByteLevel", "Metaspace", "Digits", "Punctuation"})


def _pre_tokenizer_verdict(pre: Step | None, model: Step) -> Verdict:
    if pre is None:
        return "no pre-tokenizer", ""
    steps = list(pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else [pre]
    if not steps:
        return "an empty pre-tokenizer sequence", ""
    first, *later = steps
    check = FIRST_STEPS.get(str(first.get("type")))
    if check is None:
        return f"first pre-tokenizer step {first.get('type')}", ""
    verdict = check(first, model)
    for step in later:
        if step.get("type") not in LATER_STEPS:
            return f"pre-tokenizer step {step.get('type')}", ""
    return verdict


def cut_rule(config: Mapping[str, Any]) -> CutRule:
    """The cuts of a tokenizer.json's pipeline, or why there are none (module docstring)."""
    why: str | None = None
    not_left = ""
    if config.get("truncation") is not None or config.get("padding") is not None:
        why = "truncation or padding configured"
    if why is None:
        why = _normalizer_refusal(config.get("normalizer"))
    if why is None:
        why, not_left = _pre_tokenizer_verdict(
            config.get("pre_tokenizer"), config.get("model") or {}
        )
    added = config.get("added_tokens") or []
    if (
        why is None
        and config.get("normalizer") is not None
        and any(a.get("normalized") for a in added)
    ):
        why = "an added token matched on normalised text"
    return CutRule(None if why else cut_pattern(not_left), why)


def _state(component: Any) -> Any:
    return None if component is None else json.loads(component.__getstate__())


def tokenizer_cut_rule(tokenizer: Tokenizer) -> CutRule:
    """`cut_rule` of a loaded tokenizer (its parts are read one by one: the whole
    tokenizer.json of a large vocabulary takes a second or more to serialise and parse)."""
    pre = _state(tokenizer.pre_tokenizer)
    model = tokenizer.model
    config: dict[str, Any] = {
        "truncation": tokenizer.truncation,
        "padding": tokenizer.padding,
        "normalizer": _state(tokenizer.normalizer),
        "pre_tokenizer": pre,
        "added_tokens": [
            {"normalized": t.normalized} for t in tokenizer.get_added_tokens_decoder().values()
        ],
        "model": {
            "type": type(model).__name__,
            "dropout": getattr(model, "dropout", None),
            "continuing_subword_prefix": getattr(model, "continuing_subword_prefix", None),
            "end_of_word_suffix": getattr(model, "end_of_word_suffix", None),
        },
    }
    if "Metaspace" in json.dumps(pre):  # only a one-word Metaspace looks at the vocabulary
        config["model"]["vocab"] = tokenizer.get_vocab(with_added_tokens=False)
    return cut_rule(config)
