"""Packed token storage round-trips for every width."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.bridge import packed_tokens as pt

_ids = st.lists(st.integers(0, 2**32 - 1), max_size=40)


@settings(max_examples=200, deadline=None)
@given(_ids, _ids, st.integers(0, 45), st.integers(0, 45))
def test_pack_append_unpack(first: list[int], more: list[int], a: int, b: int) -> None:
    packed, width = pt.pack(first)
    assert width == (pt.width_for(max(first)) if first else 2)
    packed, width = pt.append(packed, width, more)
    both = first + more
    assert pt.count(packed, width) == len(both)
    assert list(pt.unpack(packed, width)) == both
    lo, hi = min(a, b), max(a, b)
    assert list(pt.unpack(packed, width, lo, hi)) == both[lo:hi]


def test_widths() -> None:
    assert [pt.pack([x])[1] for x in (0, 65535, 65536, 2**24 - 1, 2**24)] == [2, 2, 3, 3, 4]
    assert len(pt.pack(list(range(100000, 100016)))[0]) == 48
