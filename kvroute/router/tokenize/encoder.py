"""Text to ids with a `tokenizers.Tokenizer`, in pieces that can be cached and reused.

Why pieces are exact: `tokenizers` first cuts the input at added tokens (the special markers a
chat template writes, like `<|im_start|>`), then normalises, pre-tokenizes and encodes each
section on its own. So if a text is cut right before an occurrence of an added token that the
tokenizer really matches there, the ids of the two halves, concatenated, are the ids of the
whole. An *anchor* is such a cut point. It must satisfy:

- the token has `normalized=False`, `lstrip=False`, `rstrip=False`, `single_word=False` (its
  match does not depend on or swallow neighbouring characters), and neither starts nor ends
  with whitespace (so `lstrip`/`rstrip` neighbours cannot eat into it);
- the longest added token matching at the cut is that token, and no added token occurrence
  starts before the cut and ends after it (else the tokenizer would match that one instead);
- the decision depends only on the characters from `cut - L + 1` to `cut + L` (L = the longest
  added token). A cache entry is reused only by texts that share them; so a cut for the cache
  lies at least L characters before the end of the text it was found in.

The piece after a cut starts with the anchor, so offset-sensitive steps (a Metaspace
pre-tokenizer with prepend scheme "first" prefixes only the piece at offset 0) see the same
offsets as in the whole text.

Plain text between added tokens is cut too where the tokenizer's pre-tokenizer always splits
(`pretok`: before a single space between two non-space characters, for the pipelines proven
safe there), unless an added token occurs within `max_added_len + 1` characters of the cut
(lstrip/rstrip tokens eat neighbouring whitespace; a token over the cut would be matched
otherwise in a half). That decision depends on the characters from `cut - L - 1` to
`cut + L + 1`. Both kinds are "anchors" below; the guard region covers either.

`add_special_tokens` is applied once, around the concatenation: the fixed prefix and suffix
the post-processor adds are measured at load time and checked.

`encode_batch_fast` is used because, unlike `encode`, it releases the GIL (measured: a thread
encoding a long text with `encode` stalls the event loop; with `encode_batch_fast` it does not)
and it skips offset computation.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from tokenizers import Tokenizer

from kvroute.router.tokenize.pretok import CUT_REACH, tokenizer_cut_rule

# Distance (characters) of the nearest checkpoint cut before a cached text's last cut; further
# checkpoints double it. About 256 tokens of English: what a departure near the end costs.
CHECKPOINT_CHARS = 1024


class TextEncoder:
    """Encodes text for one tokenizer and finds anchors (see module docstring)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        added = tokenizer.get_added_tokens_decoder()
        encode_special = bool(tokenizer.encode_special_tokens)
        contents = [t.content for t in added.values() if t.content]
        self.max_added_len = max((len(c) for c in contents), default=0)
        # Longest first, so a regex match at a position is the longest added token there.
        ordered = sorted(set(contents), key=len, reverse=True)
        self._any_added = re.compile("|".join(re.escape(c) for c in ordered)) if ordered else None
        anchors = [
            t.content
            for t in added.values()
            if t.content
            and not t.normalized
            and not t.lstrip
            and not t.rstrip
            and not t.single_word
            and not (t.special and encode_special)
            and not t.content[0].isspace()
            and not t.content[-1].isspace()
        ]
        self._anchors = frozenset(anchors)
        anchor_order = sorted(self._anchors, key=len, reverse=True)
        self._anchor_re = (
            re.compile("|".join(re.escape(c) for c in anchor_order)) if anchor_order else None
        )
        self._wrap = self._measure_special_wrap()
        rule = tokenizer_cut_rule(tokenizer)
        self._cut_re = rule.pattern
        # why plain text is not cut for this tokenizer (None: it is)
        self.pretok_refusal = rule.refusal

    @property
    def has_anchors(self) -> bool:
        """Whether any text can be cut (at added tokens or in plain text)."""
        return self._anchor_re is not None or self._cut_re is not None

    @property
    def guard_chars(self) -> int:
        """How many characters from a cut decide whether it is one (a later text must share
        them to reuse the cut)."""
        if self._cut_re is not None:
            return self.max_added_len + CUT_REACH
        return max(1, self.max_added_len)

    def _measure_special_wrap(self) -> tuple[list[int], list[int]] | None:
        """(prefix, suffix) ids that add_special_tokens puts around any single text, or None
        when the post-processor does something else."""
        probes = ["a", "Hello world", "x y\nz"]
        wrap: tuple[list[int], list[int]] | None = None
        for probe in probes:
            plain = self._tok.encode_batch_fast([probe], add_special_tokens=False)[0].ids
            full = self._tok.encode_batch_fast([probe], add_special_tokens=True)[0].ids
            n = len(plain)
            found = None
            for start in range(len(full) - n + 1):
                if full[start : start + n] == plain:
                    found = (full[:start], full[start + n :])
                    break
            if found is None or (wrap is not None and found != wrap):
                return None
            wrap = found
        return wrap

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The ids of `text`, exactly as `Tokenizer.encode` would give them."""
        return list(
            self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        )

    def encode_pieces(self, pieces: Sequence[str]) -> list[list[int]]:
        """Ids of each piece without special tokens (GIL released), on the calling thread."""
        # One call per piece: `tokenizers` spreads a batch of several over its worker threads,
        # and their waiting cost more CPU than the encode itself (measured: a 12K-token prompt
        # extending a cached one, 2 pieces in one batch 2.0 ms of process CPU, 0.6 ms of it on
        # the calling thread).
        batch = self._tok.encode_batch_fast
        return [list(batch([piece], add_special_tokens=False)[0].ids) for piece in pieces]

    def add_special(self, ids: list[int], text: str) -> list[int]:
        """`ids` (of `text`, without special tokens) with what add_special_tokens adds."""
        if self._wrap is None:
            return self.encode(text, add_special_tokens=True)
        prefix, suffix = self._wrap
        if not prefix and not suffix:
            return ids
        return [*prefix, *ids, *suffix]

    def _is_cut(self, text: str, at: int) -> bool:
        """True if the tokenizer matches an anchor starting at `at` (see module docstring)."""
        assert self._any_added is not None
        m = self._any_added.match(text, at)
        if m is None or m.group(0) not in self._anchors:
            return False
        for start in range(max(0, at - self.max_added_len + 1), at):
            other = self._any_added.match(text, start)
            if other is not None and other.end() > at:
                return False
        return True

    def _is_text_cut(self, text: str, at: int) -> bool:
        """True if no added token occurs within reach of the plain-text cut at `at`."""
        if self._any_added is None:
            return True
        reach = self.max_added_len + 1
        return self._any_added.search(text, max(0, at - reach), at + reach + 1) is None

    def _last_text_cut(self, text: str, lo: int, hi: int) -> int | None:
        if self._cut_re is None or hi <= lo:
            return None
        end = min(len(text), hi + CUT_REACH)  # the candidate at `hi` sees its right neighbour
        window = 512
        start = max(lo + 1, hi - window)
        while True:
            cuts = [m.start() for m in self._cut_re.finditer(text, start, end)]
            for j in reversed(cuts):
                if lo < j <= hi and self._is_text_cut(text, j):
                    return j
            if start <= lo + 1:
                return None
            end = start + CUT_REACH
            window *= 4
            start = max(lo + 1, start - window)

    def _first_text_cut(self, text: str, lo: int, hi: int) -> int | None:
        if self._cut_re is None:
            return None
        for m in self._cut_re.finditer(text, lo + 1, min(len(text), hi + CUT_REACH)):
            if m.start() > hi:
                return None
            if self._is_text_cut(text, m.start()):
                return m.start()
        return None

    def last_anchor(self, text: str, lo: int, hi: int) -> int | None:
        """The largest cut position `j` with `lo < j <= hi` (None if there is none)."""
        text_cut = self._last_text_cut(text, lo, hi)
        # an added-token anchor counts only after it (so a long plain text is not searched)
        added = self._last_added_anchor(text, lo if text_cut is None else text_cut, hi)
        return added if added is not None else text_cut

    def _last_added_anchor(self, text: str, lo: int, hi: int) -> int | None:
        if self._anchor_re is None or hi <= lo:
            return None
        window = 2048
        end = hi + self.max_added_len
        start = max(lo + 1, hi - window)
        while True:
            positions = [
                m.start() for m in self._anchor_re.finditer(text, start, min(end, len(text)))
            ]
            # finditer skips overlapping occurrences; _is_cut re-checks each candidate anyway.
            for j in reversed(positions):
                if lo < j <= hi and self._is_cut(text, j):
                    return j
            if start <= lo + 1:
                return None
            end = start + self.max_added_len
            window *= 4
            start = max(lo + 1, start - window)

    def first_cache_anchor(self, text: str, lo: int) -> int | None:
        """The first cut in `text` after `lo` that stays valid when `text` is extended later
        (where a conversation's first message, such as a shared system prompt, ends)."""
        hi = len(text) - self.guard_chars
        found = [
            j
            for j in (self._first_added_anchor(text, lo, hi), self._first_text_cut(text, lo, hi))
            if j is not None
        ]
        return min(found) if found else None

    def _first_added_anchor(self, text: str, lo: int, hi: int) -> int | None:
        if self._anchor_re is None:
            return None
        for m in self._anchor_re.finditer(text, lo + 1, max(lo + 1, hi + 1)):
            if self._is_cut(text, m.start()):
                return m.start()
        return None

    def cache_anchor(self, text: str, lo: int) -> int | None:
        """A cut in `text` after `lo` that stays valid when `text` is extended later."""
        return self.last_anchor(text, lo, len(text) - self.guard_chars)

    def checkpoint_anchors(self, text: str, lo: int, end: int) -> list[int]:
        """Cuts after `lo` at about `CHECKPOINT_CHARS`, twice, four times ... that many
        characters before the cut `end`, descending: a later text that departs from this one
        d characters before `end` still shares a cut at most about 2d before `end`."""
        out: list[int] = []
        back = CHECKPOINT_CHARS
        while end - back > lo:
            j = self.last_anchor(text, lo, end - back)
            if j is None:
                break
            if not out or j < out[-1]:
                out.append(j)
            back *= 2
        return out
