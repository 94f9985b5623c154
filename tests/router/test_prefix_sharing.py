"""Which prefixes other sessions asked for (`router.prefix_sharing`), against a plain model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.prefix_sharing import PrefixSharing

UNIT = 16


def chain(tokens: list[int]) -> list[int]:
    """Keys that chain their prefix, as the index's content keys do (one per hash unit)."""
    return [hash(tuple(tokens[: (i + 1) * UNIT])) for i in range(len(tokens) // UNIT)]


def prompt(*parts: tuple[int, int]) -> list[int]:
    """Token ids made of (value, units) runs."""
    out: list[int] = []
    for value, units in parts:
        out.extend([value] * (units * UNIT))
    return out


def test_own_history_is_not_shared_but_another_sessions_prefix_is() -> None:
    s = PrefixSharing(UNIT, 1000)
    history = prompt((1, 3), (2, 5))  # 3 units of system prompt, 5 of the conversation
    s.note(chain(history), "alice")
    follow_up = chain(history + prompt((3, 2)))
    assert s.shared_tokens(follow_up, "alice") == 0
    # bob's conversation shares only the system prompt with alice's
    bobs = chain(prompt((1, 3), (9, 4)))
    assert s.shared_tokens(bobs, "bob") == 3 * UNIT
    # alice asking for a prompt bob shares with her: the shared run counts for both
    s.note(bobs, "bob")
    assert s.shared_tokens(follow_up, "alice") == 3 * UNIT
    assert s.shared_tokens(chain(prompt((1, 3), (9, 4), (5, 1))), "bob") == 3 * UNIT


def test_requests_without_a_session_share_with_each_other() -> None:
    s = PrefixSharing(UNIT, 1000)
    doc = prompt((7, 10))
    s.note(chain(doc + prompt((1, 1))), object())
    assert s.shared_tokens(chain(doc + prompt((2, 1))), object()) == 10 * UNIT
    assert s.shared_tokens(chain(prompt((8, 4))), object()) == 0  # never asked for
    assert s.shared_tokens([], "x") == 0


def test_the_oldest_keys_are_forgotten_at_the_bound() -> None:
    s = PrefixSharing(UNIT, 8)
    first = chain(prompt((1, 6)))
    s.note(first, "a")
    s.note(chain(prompt((2, 6))), "b")
    assert len(s) == 8 and s.forgotten == 4
    # the first prompt's first four keys are gone, so the shared run ends before them
    assert s.shared_tokens(first, "c") == 0
    assert s.shared_tokens(chain(prompt((2, 6))), "c") == 6 * UNIT
    with pytest.raises(ValueError):
        PrefixSharing(UNIT, 0)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.booleans(),  # note (True) or ask (False)
            st.sampled_from(["a", "b", "c", None]),
            st.lists(st.integers(0, 2), min_size=0, max_size=6),  # unit values: few prefixes
        ),
        max_size=30,
    )
)
def test_matches_a_model_of_sessions_per_prefix(
    ops: list[tuple[bool, str | None, list[int]]],
) -> None:
    s = PrefixSharing(UNIT, 10_000)  # never reached here: the model has no bound
    askers: dict[tuple[int, ...], set[object]] = {}
    for n, (is_note, session, units) in enumerate(ops):
        owner: object = session if session is not None else ("request", n)
        tokens = [t for u in units for t in [u] * UNIT]
        keys = chain(tokens)
        if is_note:
            s.note(keys, owner)
            for i in range(len(units)):
                askers.setdefault(tuple(tokens[: (i + 1) * UNIT]), set()).add(owner)
        else:
            expected = 0
            for i in range(len(units)):
                if askers.get(tuple(tokens[: (i + 1) * UNIT]), set()) - {owner}:
                    expected = (i + 1) * UNIT
            assert s.shared_tokens(keys, owner) == expected
