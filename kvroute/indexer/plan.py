"""The fleet's scoring plan: workers grouped by layout into bitset masks.

Workers with the same rule parameters share one mask, so scoring does one bit operation
per class and position whatever the fleet size. Rebuilt only when some worker's layout
changes (a group joins, a block size grows, a view is discarded, an alignment override).

The bitset path covers every layout whose full-attention units are either all
block-aligned (alignment a multiple of their block size) or a single unit in vLLM's
fine-grained mode; other layouts (several full units with partial hits, or overrides
that cut full blocks) are scored per worker with the reference rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvroute.indexer.layout import Layout, Rule


@dataclass(slots=True)
class FullWalk:
    """Coverage from token 0 of one full-attention unit shape (slots, block size)."""

    slots: tuple[int, ...]
    block_size: int
    mask: int = 0
    fine: dict[int, int] = field(default_factory=dict)  # alignment -> fine-mode workers


@dataclass(slots=True)
class SparseClass:
    """One sliding-window or Mamba unit shape and the workers that have it."""

    rule: Rule
    slots: tuple[int, ...]
    block_size: int
    need: int  # sliding window: blocks ending at the hit
    fine: bool  # Mamba: any aligned position, not only block ends
    mask: int = 0
    notmask: int = -1


@dataclass(slots=True)
class Plan:
    """Masks over worker indexes for one fleet state."""

    usable: int = 0  # workers with a usable layout
    fast: int = 0  # usable workers scored by the bitset path
    fallback: list[int] = field(default_factory=list)  # usable workers scored one by one
    walks: list[FullWalk] = field(default_factory=list)
    overlap: bool = False  # some worker has several full units
    sparse: list[SparseClass] = field(default_factory=list)
    sparse_mask: int = 0  # fast workers with a sliding-window or Mamba unit
    nofull_mask: int = 0  # fast workers without a full-attention unit
    alignments: list[tuple[int, int]] = field(default_factory=list)  # (alignment, workers)


def _fast(layout: Layout) -> bool:
    full = [u for u in layout.units if u.rule is Rule.FULL]
    a = layout.alignment
    if all(a % u.block_size == 0 for u in full):
        return True
    return len(full) == 1 and full[0].fine(a)


def build_plan(layouts: dict[int, Layout]) -> Plan:
    """Group usable workers (by index) into walks and classes."""
    plan = Plan()
    walks: dict[tuple[tuple[int, ...], int], FullWalk] = {}
    sparse: dict[tuple[Rule, tuple[int, ...], int, int, bool], SparseClass] = {}
    alignments: dict[int, int] = {}
    for index, layout in layouts.items():
        if not layout.usable:
            continue
        bit = 1 << index
        plan.usable |= bit
        if not _fast(layout):
            plan.fallback.append(index)
            continue
        plan.fast |= bit
        a = layout.alignment
        alignments[a] = alignments.get(a, 0) | bit
        n_full = 0
        for unit in layout.units:
            if unit.rule is Rule.FULL:
                n_full += 1
                walk = walks.setdefault(
                    (unit.slots, unit.block_size), FullWalk(unit.slots, unit.block_size)
                )
                if walk.mask & bit:  # two identical units cannot exist; be safe
                    continue
                walk.mask |= bit
                if unit.fine(a):
                    walk.fine[a] = walk.fine.get(a, 0) | bit
                continue
            fine = unit.rule is Rule.STATE and unit.fine(a)
            need = unit.window_blocks if unit.rule is Rule.WINDOW else 0
            key = (unit.rule, unit.slots, unit.block_size, need, fine)
            cls = sparse.setdefault(
                key, SparseClass(unit.rule, unit.slots, unit.block_size, need, fine)
            )
            cls.mask |= bit
            cls.notmask = ~cls.mask
            plan.sparse_mask |= bit
        if n_full == 0:
            plan.nofull_mask |= bit
        elif n_full > 1:
            plan.overlap = True
    plan.walks = list(walks.values())
    # cheap classes first: a Mamba state is one AND, a window one per block
    plan.sparse = sorted(sparse.values(), key=lambda c: (c.rule is Rule.WINDOW, c.need))
    plan.alignments = sorted(alignments.items())
    return plan
