"""Which prefixes other sessions asked for (`kvroute.router.routing.prefix_sharing`), against a
plain model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.routing.prefix_sharing import PrefixSharing

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


def test_own_history_starts_where_only_the_session_asked() -> None:
    s = PrefixSharing(UNIT, 1000)
    history = prompt((1, 3), (2, 5))  # 3 units of system prompt, 5 of the conversation
    s.note(chain(history), "alice")
    follow_up = chain(history + prompt((3, 2)))
    assert s.own_from(follow_up, "alice") == 0  # nobody else asked for any of it
    # bob's conversation shares only the system prompt with alice's: none of it is his own
    bobs = chain(prompt((1, 3), (9, 4)))
    assert s.own_from(bobs, "bob") is None
    s.note(bobs, "bob")
    # now the system prompt is shared: alice's own history starts after it, bob's too
    assert s.own_from(follow_up, "alice") == 3 * UNIT
    assert s.own_from(chain(prompt((1, 3), (9, 4), (5, 1))), "bob") == 3 * UNIT


def test_requests_without_a_session_have_no_own_history() -> None:
    s = PrefixSharing(UNIT, 1000)
    doc = prompt((7, 10))
    first = object()
    s.note(chain(doc + prompt((1, 1))), first)
    assert s.own_from(chain(doc + prompt((2, 1))), object()) is None
    assert s.own_from(chain(doc + prompt((1, 1))), first) == 0  # the same request again
    assert s.own_from(chain(prompt((8, 4))), "x") is None  # never asked for
    assert s.own_from([], "x") is None


def test_the_oldest_keys_are_forgotten_at_the_bound() -> None:
    s = PrefixSharing(UNIT, 8)
    first = chain(prompt((1, 6)))
    s.note(first, "a")
    s.note(chain(prompt((2, 6))), "b")
    assert len(s) == 8 and s.forgotten == 4
    # the first prompt's first four keys are gone: not known, so not "a"'s own
    assert s.own_from(first, "a") is None
    assert s.own_from(chain(prompt((2, 6))), "b") == 0
    with pytest.raises(ValueError):
        PrefixSharing(UNIT, 0)


def test_a_prompt_whose_first_keys_were_forgotten_is_answered() -> None:
    """The bound forgets the oldest keys first, which are a conversation's first ones: the
    rest of its prompt stays known. Regression: `own_from` raised KeyError on such a prompt
    (the router's every later turn of that conversation)."""
    s = PrefixSharing(UNIT, 6)
    turn = chain(prompt((1, 6)))
    s.note(turn, "a")
    longer = chain(prompt((1, 6), (2, 2)))
    s.note(longer, "a")  # two new keys: the first two of the conversation are forgotten
    assert s.forgotten == 2
    assert s.own_from(longer, "a") == 2 * UNIT  # from the first key still known as its own
    assert s.own_from(longer, "b") is None


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 4), st.booleans()), max_size=40),
    bound=st.integers(1, 30),
)
def test_growing_conversations_at_any_bound_get_a_position_in_the_prompt(
    ops: list[tuple[int, int, bool]], bound: int
) -> None:
    """Conversations sharing a system prompt grow turn by turn while the bound forgets their
    oldest keys: every lookup answers a position inside the prompt (or None)."""
    s = PrefixSharing(UNIT, bound)
    convs = [prompt((9, 2)) for _ in range(3)]
    for c, grow, is_note in ops:
        convs[c] += prompt(*((100 * c + len(convs[c]) // UNIT + i, 1) for i in range(grow)))
        keys = chain(convs[c] + prompt((7, 1)))  # the turn asked for now
        if is_note:
            s.note(keys, c)
            assert len(s) <= bound
        else:
            got = s.own_from(keys, c)
            assert got is None or (0 <= got < len(keys) * UNIT and got % UNIT == 0)


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
            expected = None
            for i in range(len(units)):
                if askers.get(tuple(tokens[: (i + 1) * UNIT])) == {owner}:
                    expected = i * UNIT
                    break
            assert s.own_from(keys, owner) == expected
