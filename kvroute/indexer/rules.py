"""vLLM's longest-hit rules, one per group kind, and the coordinator that combines them.

Each function mirrors one manager of `vllm/v1/core/single_type_kv_cache_manager.py`:
given which content keys a unit holds (`present`), the request's keys and a maximum
length, it returns the longest hit (in tokens) the unit allows. `longest_hit` is the
hybrid coordinator's fixed point. These per-worker functions serve `GroupCache`, the
per-group breakdown and layouts the fleet's bitset path does not cover.

Positions are in tokens; the key of position p (a multiple of the hash unit) is
`keys[p // hash_unit - 1]`.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

from kvroute.indexer.layout import Layout, Rule, Unit, fine_grained


def longest_full(
    present: Container[int],
    keys: Sequence[int],
    max_length: int,
    block_size: int,
    alignment: int,
    hash_unit: int,
) -> int:
    """Full attention: blocks contiguous from token 0; in fine-grained mode also a
    partial entry inside the first block that is not cached (highest first)."""
    step = block_size // hash_unit
    blocks = 0
    limit = max_length // block_size
    while blocks < limit and keys[(blocks + 1) * step - 1] in present:
        blocks += 1
    hit = blocks * block_size
    if fine_grained(block_size, alignment):
        top = min(hit + block_size - alignment, max_length - max_length % alignment)
        for p in range(top, hit, -alignment):
            if keys[p // hash_unit - 1] in present:
                hit = p
                break
    return hit - hit % alignment


def longest_window(
    present: Container[int],
    keys: Sequence[int],
    max_length: int,
    block_size: int,
    need: int,
    alignment: int,
    hash_unit: int,
) -> int:
    """Sliding window: `need` cached blocks ending at the hit (the run must end on an
    aligned boundary), or, failing that, a shorter run contiguous from block 0."""
    step = block_size // hash_unit
    run = 0
    for i in range(max_length // block_size - 1, -1, -1):
        if keys[(i + 1) * step - 1] in present:
            if run == 0 and ((i + 1) * block_size) % alignment:
                continue
            run += 1
            if run >= need:
                return (i + run) * block_size
        else:
            run = 0
    hit = run * block_size
    while hit % alignment:
        hit -= block_size
    return hit


def longest_state(
    present: Container[int],
    keys: Sequence[int],
    max_length: int,
    block_size: int,
    alignment: int,
    hash_unit: int,
) -> int:
    """Mamba: the highest position with a state saved exactly there; in fine-grained
    mode any aligned position (full block or partial checkpoint), else block ends."""
    if fine_grained(block_size, alignment):
        for p in range(max_length - max_length % alignment, 0, -alignment):
            if keys[p // hash_unit - 1] in present:
                return p
        return 0
    for i in range(max_length // block_size - 1, -1, -1):
        p = (i + 1) * block_size
        if p % alignment == 0 and keys[p // hash_unit - 1] in present:
            return p
    return 0


def unit_longest(
    unit: Unit,
    present: Container[int],
    keys: Sequence[int],
    max_length: int,
    alignment: int,
    hash_unit: int,
) -> int:
    """The longest hit one unit allows, at most `max_length`."""
    if unit.rule is Rule.FULL:
        return longest_full(present, keys, max_length, unit.block_size, alignment, hash_unit)
    if unit.rule is Rule.WINDOW:
        return longest_window(
            present, keys, max_length, unit.block_size, unit.window_blocks, alignment, hash_unit
        )
    return longest_state(present, keys, max_length, unit.block_size, alignment, hash_unit)


def longest_hit(
    layout: Layout,
    presence: Callable[[Unit], Container[int]],
    keys: Sequence[int],
    cap: int,
    hash_unit: int,
) -> int:
    """vLLM's hybrid coordinator: every unit shrinks the candidate in turn until no unit
    changes it; full-attention units are looked up once and then only clamp."""
    hit = cap
    full_results: dict[int, int] = {}
    while True:
        current = hit
        for index, unit in enumerate(layout.units):
            if index in full_results:
                current = min(current, full_results[index])
                continue
            current = unit_longest(unit, presence(unit), keys, current, layout.alignment, hash_unit)
            if unit.rule is Rule.FULL:
                full_results[index] = current
        if current >= hit:
            return hit
        hit = current
