"""Conversation chains of a Mooncake trace and the development / held-out split."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.testbed.trace import MooncakeRecord, read_mooncake
from kvroute.testbed.trace_chains import describe, link_chains, main, sample, side_of


def _reference_links(
    hash_lists: list[list[int]], min_shared: int
) -> tuple[list[int | None], list[int]]:
    """Quadratic reference: for each request, scan every earlier one."""
    parents: list[int | None] = []
    shared: list[int] = []
    for i, blocks in enumerate(hash_lists):
        best, best_len = None, 0
        for j in range(i):
            other = hash_lists[j]
            n = 0
            while n < min(len(blocks), len(other)) and blocks[n] == other[n]:
                n += 1
            if n >= best_len and n > 0:  # ties go to the latest request
                best, best_len = j, n
        if best_len >= min_shared:
            parents.append(best)
            shared.append(best_len)
        else:
            parents.append(None)
            shared.append(0)
    return parents, shared


# Small alphabets so that prefixes are shared often.
hash_lists = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=6), max_size=25)


@settings(max_examples=300, deadline=None)
@given(hash_lists, st.integers(1, 3))
def test_links_match_the_quadratic_reference(lists: list[list[int]], min_shared: int) -> None:
    links = link_chains(lists, min_shared)
    parents, shared = _reference_links(lists, min_shared)
    assert list(links.parent) == parents
    assert list(links.shared_blocks) == shared
    for i, p in enumerate(links.parent):
        # A chain id is the first request of the chain, reached through parents.
        assert links.chain[i] == (i if p is None else links.chain[p])
        assert links.chain[i] <= i


def test_a_shared_system_block_does_not_join_conversations() -> None:
    # Every request starts with block 0 (a system prompt); two conversations extend it.
    lists = [[0, 1, 2], [0, 5, 6], [0, 1, 2, 3], [0, 5, 6, 7], [0, 9]]
    links = link_chains(lists, min_shared_blocks=2)
    assert links.chain == (0, 1, 0, 1, 4)
    assert links.parent == (None, None, 0, 1, None)


def test_split_is_keyed_and_balanced() -> None:
    sides = [side_of(i) for i in range(4000)]
    share = sides.count("heldout") / len(sides)
    assert 0.45 < share < 0.55
    assert sides == [side_of(i) for i in range(4000)]  # no hidden state
    assert sides != [side_of(i, key="another key") for i in range(4000)]


def _records(lists: list[list[int]], times_s: list[float]) -> list[MooncakeRecord]:
    return [
        MooncakeRecord(t * 1000.0, 512 * len(h), 8, tuple(h))
        for h, t in zip(lists, times_s, strict=True)
    ]


@settings(max_examples=100, deadline=None)
@given(hash_lists.filter(lambda x: len(x) > 0), st.floats(0, 20), st.floats(0.5, 20))
def test_sample_takes_whole_chains_of_one_side(
    lists: list[list[int]], start: float, duration: float
) -> None:
    lists = [h or [99] for h in lists]
    recs = _records(lists, [float(i) for i in range(len(lists))])
    links = link_chains(lists)
    for side in ("dev", "heldout"):
        picked = sample(recs, links, side, start, duration)
        chains = {links.chain[i] for i in picked}
        assert all(side_of(c) == side for c in chains)
        # Whole chains: every member of a picked chain is picked.
        assert picked == [i for i in range(len(lists)) if links.chain[i] in chains]
        assert all(start <= recs[c].timestamp_ms / 1000.0 < start + duration for c in chains)
    dev = set(sample(recs, links, "dev", start, duration))
    held = set(sample(recs, links, "heldout", start, duration))
    assert not dev & held


def test_cli_writes_a_mooncake_trace_of_the_sample(tmp_path: Path) -> None:
    lists = [[0, i, i + 100] for i in range(1, 60)] + [[0, i, i + 100, 7] for i in range(1, 60)]
    src = tmp_path / "trace.jsonl"
    src.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": 1000 * k,
                    "input_length": 512 * len(h),
                    "output_length": 4,
                    "hash_ids": h,
                }
            )
            + "\n"
            for k, h in enumerate(lists)
        )
    )
    out = tmp_path / "held.jsonl"
    assert (
        main(["--trace", str(src), "--side", "heldout", "--duration-s", "1000", "--out", str(out)])
        == 0
    )
    got = list(read_mooncake(out))
    expected = [i for i in range(len(lists)) if side_of(i % 59) == "heldout"]
    assert [list(r.hash_ids) for r in got] == [lists[i] for i in expected]
    assert 0 < len(got) < len(lists)


def test_describe_counts_the_sample() -> None:
    lists = [[0, 1], [0, 1, 2], [0, 7]]
    recs = _records(lists, [0.0, 1.0, 2.0])
    links = link_chains(lists)
    d = describe(recs, links, [0, 1, 2])
    assert d["requests"] == 3 and d["chains"] == 2
    # Only request 1 extends its parent, by two blocks of its three.
    assert d["chain_prefix_share"] == round(2 / 7, 4)
    assert d["mean_prompt_tokens"] == round(512 * 7 / 3, 1)
