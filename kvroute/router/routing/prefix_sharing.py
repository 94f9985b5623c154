"""Which prompt prefixes other sessions have asked for: the test that a junction is worth it.

On hybrid models vLLM saves sliding-window and Mamba state where a request's full-attention
blocks ended (a junction), so serving a request where full attention already holds its
prefix makes that prefix reusable for the *next* request that shares it. That is worth
paying for only when other conversations share the prefix (a tenant's system prompt, a
hot document's burst). A conversation's own history gains nothing: wherever its turn is
served, vLLM keeps the state at the end of that prompt, which is where the next turn
branches.

`PrefixSharing` remembers, per index key of prompts this router sent, the session that asked
for it (or that several did), so the junction credit can stop where a prompt becomes its own
conversation's history. Bounded: the oldest keys are forgotten first.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Hashable, Sequence
from itertools import islice

_SHARED = object()  # asked for by at least two sessions


class PrefixSharing:
    def __init__(self, hash_unit: int, max_keys: int) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        self._unit = hash_unit
        self._max = max_keys
        self._owner: dict[int, object] = {}
        self.forgotten = 0  # keys dropped at the bound

    def __len__(self) -> int:
        return len(self._owner)

    def note(self, keys: Sequence[int], session: Hashable) -> None:
        """Record that `session` asked for a prompt with these keys."""
        owner = self._owner
        setdefault = owner.setdefault
        for k in keys:
            seen = setdefault(k, session)
            if seen is not _SHARED and seen != session:
                owner[k] = _SHARED
        excess = len(owner) - self._max
        if excess > 0:
            # dicts keep insertion order: the first keys are the oldest
            for k in list(islice(owner, excess)):
                del owner[k]
            self.forgotten += excess

    def own_from(self, keys: Sequence[int], session: Hashable) -> int | None:
        """Prompt tokens (a multiple of the hash unit) before the first key that only
        `session` asked for: where the prompt becomes that conversation's own history.
        None when no key is known to be its own (a new prompt, or one another replica
        routed: credited as before this rule, so replicas agree on what they both do not
        know). Keys chain their prefix, so the keys asked for are a leading run and, within
        it, those only `session` asked for a trailing one: both found by bisection. Once the
        bound has forgotten a prompt's first keys the runs are no longer leading; a forgotten
        key then counts as not its own, so the answer stays a position in the prompt."""
        owner = self._owner
        get = owner.get
        # keys[:asked] were asked for (the predicate is False, then True)
        asked = bisect_left(keys, True, key=lambda k: k not in owner)
        # within them, those from `first_own` on were asked for by `session` alone
        first_own = bisect_left(keys, True, 0, asked, key=lambda k: get(k) == session)
        return first_own * self._unit if first_own < asked else None
