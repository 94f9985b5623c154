"""A worker's KV cache layout as learned from its events, and vLLM's alignment rule.

Mirrors `vllm/v1/core/kv_cache_coordinator.py`: groups with the same kind, block size and
window are looked up together as one unit (a block counts only if every group of the
unit holds it), full-attention units come first, and the hit is aligned to the LCM of
the group block sizes, or to the hash unit when vLLM enables partial hash hits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum


class Rule(Enum):
    """How a group kind accepts a hit position (one vLLM manager class each)."""

    FULL = "full"  # contiguous coverage from token 0 (full, MLA, sink-full attention)
    WINDOW = "window"  # the window's blocks ending at the position (sliding window)
    STATE = "state"  # a state saved exactly at the position (Mamba)


_RULE_OF_KIND: dict[str, Rule] = {
    "full_attention": Rule.FULL,
    "mla_attention": Rule.FULL,
    "sink_full_attention": Rule.FULL,
    "sliding_window": Rule.WINDOW,
    "sliding_window_mla": Rule.WINDOW,
    "mamba": Rule.STATE,
}


def fine_grained(block_size: int, alignment: int) -> bool:
    """Whether a group of this block size is looked up at `alignment` inside its blocks
    (vLLM's fine-grained mode, for full attention and Mamba): the alignment divides it."""
    return alignment < block_size and block_size % alignment == 0


def check_alignment(alignment: int | None, hash_unit: int) -> None:
    """ValueError unless `alignment` (an override; None = inferred) is a positive multiple
    of the hash unit."""
    if alignment is not None and (alignment <= 0 or alignment % hash_unit):
        raise ValueError("alignment must be a positive multiple of the hash unit")


def rule_of(kind: str, sliding_window: int) -> Rule | None:
    """The acceptance rule of a group kind, or None when kvroute cannot model it
    (chunked local attention needs a chunk size the events do not carry; encoder-only,
    cross-attention, unknown and unnamed kinds are not prefix-cacheable as far as the
    events can tell)."""
    rule = _RULE_OF_KIND.get(kind)
    if rule is Rule.WINDOW and sliding_window <= 0:
        return None
    return rule


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV cache group as reported: kind and window verbatim, the largest block size
    seen (smaller ones are partial entries), and its slot in the worker's tables."""

    group_id: int
    slot: int
    kind: str
    block_size: int
    sliding_window: int


@dataclass(frozen=True, slots=True)
class Unit:
    """Groups vLLM looks up together: same kind, block size and window."""

    rule: Rule
    kind: str
    block_size: int
    sliding_window: int
    slots: tuple[int, ...]
    group_ids: tuple[int, ...]

    @property
    def window_blocks(self) -> int:
        """Sliding window: blocks needed ending at the hit, cdiv(W - 1, block) (at least 1)."""
        return max(1, -(-(self.sliding_window - 1) // self.block_size))

    def fine(self, alignment: int) -> bool:
        """vLLM's fine-grained lookup (partial hits inside a block) for this unit."""
        return self.rule is not Rule.WINDOW and fine_grained(self.block_size, alignment)


@dataclass(frozen=True, slots=True)
class Layout:
    """What scoring needs to know about one worker; `reason` is empty when usable."""

    groups: tuple[GroupSpec, ...]
    units: tuple[Unit, ...]  # full-attention units first, then the others, by group id
    alignment: int  # 0 when unusable
    reason: str

    @property
    def usable(self) -> bool:
        """Whether the worker can be scored."""
        return not self.reason

    def shape(self) -> tuple[object, ...]:
        """What scoring reads of the layout, without the worker's table slots: two
        workers of one shape accept the same hits."""
        return (
            self.alignment,
            tuple((u.rule, u.block_size, u.sliding_window, u.group_ids) for u in self.units),
        )

    def junction_state(self, junction: int) -> int:
        """Where vLLM keeps sliding-window and Mamba state for a request whose
        shared-prefix junction is `junction` tokens (`reachable_block_mask` in vLLM's
        single_type_kv_cache_manager.py): the junction aligned down, then down to the
        group's block, so a sliding window keeps the tail ending there and a Mamba group
        the state block ending there (64-token Mamba blocks: a junction at 80 saves 64).
        0 when the sparse groups keep it at different positions (no joint hit there)."""
        aligned = junction - junction % self.alignment if self.alignment else 0
        ends = {aligned - aligned % u.block_size for u in self.units if u.rule is not Rule.FULL}
        if len(ends) > 1:
            return 0
        return ends.pop() if ends else aligned


def _units(groups: tuple[GroupSpec, ...]) -> tuple[Unit, ...]:
    merged: dict[tuple[str, int, int], list[GroupSpec]] = {}
    for g in sorted(groups, key=lambda g: g.group_id):
        merged.setdefault((g.kind, g.block_size, g.sliding_window), []).append(g)
    units = []
    for (kind, block_size, window), members in merged.items():
        rule = rule_of(kind, window)
        assert rule is not None
        units.append(
            Unit(
                rule,
                kind,
                block_size,
                window,
                tuple(g.slot for g in members),
                tuple(g.group_id for g in members),
            )
        )
    # vLLM sorts full-attention units first (a stable sort over group order).
    units.sort(key=lambda u: (u.rule is not Rule.FULL, u.group_ids[0]))
    return tuple(units)


def infer_alignment(groups: tuple[GroupSpec, ...], unit_gcd: int) -> int:
    """vLLM's cache-hit alignment for these groups (`_cache_hit_alignment_tokens`).

    One group: its block size. Several: the hash block size (the GCD of every block size
    seen, partial entries included) when partial hash hits are on, that is when some
    Mamba group's block is larger than it and every other group either supports
    fine-grained lookup (full attention, Mamba) or has exactly that block size;
    otherwise the LCM of the group block sizes.
    """
    if len(groups) == 1:
        return groups[0].block_size
    hash_block = unit_gcd
    partial_hits = any(
        rule_of(g.kind, g.sliding_window) is Rule.STATE and g.block_size > hash_block
        for g in groups
    ) and all(
        rule_of(g.kind, g.sliding_window) in (Rule.FULL, Rule.STATE) or g.block_size == hash_block
        for g in groups
    )
    if partial_hits:
        return hash_block
    return math.lcm(*(g.block_size for g in groups))


def build_layout(
    groups: tuple[GroupSpec, ...], unit_gcd: int, hash_unit: int, override: int | None
) -> Layout:
    """The layout of a worker, or an unusable one with the reason."""
    if not groups:
        return Layout(groups, (), 0, "no KV cache groups reported")
    for g in groups:
        if rule_of(g.kind, g.sliding_window) is None:
            what = f"kind {g.kind!r}" if g.kind else "no kind"
            if g.kind in ("sliding_window", "sliding_window_mla"):
                what += " without a window"
            return Layout(groups, (), 0, f"group {g.group_id} has {what}: not modelled")
        if g.block_size % hash_unit:
            return Layout(
                groups,
                (),
                0,
                f"group {g.group_id} block size {g.block_size} is not a multiple of the "
                f"hash unit {hash_unit}",
            )
    if unit_gcd % hash_unit:
        return Layout(
            groups,
            (),
            0,
            f"partial entries of {unit_gcd} tokens are finer than the hash unit {hash_unit}",
        )
    alignment = override if override is not None else infer_alignment(groups, unit_gcd)
    if alignment <= 0 or alignment % hash_unit:
        return Layout(
            groups, (), 0, f"alignment {alignment} is not a multiple of the hash unit {hash_unit}"
        )
    return Layout(groups, _units(groups), alignment, "")
