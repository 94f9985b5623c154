"""Scoring a request against the whole fleet at once, with integer bitsets.

Per worker the answer is vLLM's fixed point, rewritten so that workers can be answered
together (`rules.longest_hit` is the per-worker form):

1. Full attention (looked up once, first): walk the request's block keys from token 0;
   `alive` is the set of workers still covered. Each time workers drop out, their
   coverage is known. A worker's full-attention bound F is its coverage (the minimum
   over its full units) aligned down; in fine-grained mode a partial entry inside the
   first uncovered block extends it.
2. Workers with only full attention answer F.
3. The others answer the largest aligned p <= F that every sliding-window and Mamba
   unit accepts. Such a p has a block or state ending exactly at p, so only positions
   where some sparse group holds the request's key are visited, from the end down;
   at each, one AND per class (a window: one per block of the window, stopping early)
   narrows the workers that accept it, and they are answered.

The work is proportional to the prompt (keys looked up once per slot) plus the number
of distinct answers, not to prompt x workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress

from indexer.inverted import decode
from indexer.layout import Rule
from indexer.plan import FullWalk, Plan, SparseClass


def coverage(
    walk: FullWalk, slots: list[dict[int, int]], keys: Sequence[int], m: int, unit: int
) -> list[tuple[int, int]]:
    """(coverage in tokens, workers) for the walk's workers, coverage ascending. Coverage
    counts whole blocks from token 0 that end at or before position m * unit."""
    block = walk.block_size
    step = block // unit
    alive = walk.mask
    events: list[tuple[int, int]] = []
    covered = 0
    i = step - 1
    if len(walk.slots) == 1:
        get = slots[walk.slots[0]].get
        while alive and i < m:
            v = get(keys[i])
            if v is None:
                nxt = 0
            elif v < 0:
                nxt = alive & (1 << ~v)
            else:
                nxt = alive & v
            if nxt != alive:
                events.append((covered, alive ^ nxt))
                alive = nxt
            covered += block
            i += step
    else:
        gets = [slots[s].get for s in walk.slots]
        while alive and i < m:
            nxt = alive
            for get in gets:
                nxt &= decode(get(keys[i]))
            if nxt != alive:
                events.append((covered, alive ^ nxt))
                alive = nxt
            covered += block
            i += step
    if alive:
        events.append((covered, alive))
    return events


def min_coverage(
    walks: list[FullWalk], per_walk: list[list[tuple[int, int]]]
) -> list[tuple[int, int]]:
    """(minimum coverage over a worker's full units, workers)."""
    every = 0
    for walk in walks:
        every |= walk.mask
    values = sorted({c for events in per_walk for c, _ in events}, reverse=True)
    desc = [sorted(events, reverse=True) for events in per_walk]
    ptr = [0] * len(walks)
    ge = [0] * len(walks)
    out: list[tuple[int, int]] = []
    done = 0
    for c in values:
        ok = every
        for w, events in enumerate(desc):
            while ptr[w] < len(events) and events[ptr[w]][0] >= c:
                ge[w] |= events[ptr[w]][1]
                ptr[w] += 1
            ok &= ge[w] | ~walks[w].mask
        new = ok & ~done
        if new:
            out.append((c, new))
            done |= new
    return out


def _bits(slots: list[dict[int, int]], walk_slots: tuple[int, ...], key: int) -> int:
    bits = -1
    for s in walk_slots:
        bits &= decode(slots[s].get(key))
    return bits if bits != -1 else 0


def full_bounds(
    plan: Plan, slots: list[dict[int, int]], keys: Sequence[int], cap: int, unit: int
) -> list[tuple[int, int]]:
    """Each fast worker's full-attention bound F (aligned), as (F, workers)."""
    m = min(len(keys), cap // unit)
    per_walk = [coverage(walk, slots, keys, m, unit) for walk in plan.walks]
    if plan.overlap:
        events = min_coverage(plan.walks, per_walk)
    else:
        events = [e for walk_events in per_walk for e in walk_events]
    fine_all = 0
    for walk in plan.walks:
        for mask in walk.fine.values():
            fine_all |= mask
    out: list[tuple[int, int]] = []
    for covered, workers in events:
        workers &= ~fine_all
        if not workers:
            continue
        for alignment, mask in plan.alignments:
            hit = workers & mask
            if hit:
                out.append((covered - covered % alignment, hit))
    if fine_all:
        for walk, walk_events in zip(plan.walks, per_walk, strict=True):
            for alignment, mask in walk.fine.items():
                for covered, workers in walk_events:
                    rest = workers & mask
                    if not rest:
                        continue
                    # a partial entry inside the first uncovered block, highest first
                    top = min(covered + walk.block_size - alignment, cap - cap % alignment)
                    for p in range(top, covered, -alignment):
                        hit = rest & _bits(slots, walk.slots, keys[p // unit - 1])
                        if hit:
                            out.append((p, hit))
                            rest ^= hit
                            if not rest:
                                break
                    if rest:
                        out.append((covered, rest))
    if plan.nofull_mask:
        out.append((cap, plan.nofull_mask))
    return out


def _accept(
    cls: SparseClass,
    vals: dict[int, list[int | None]],
    i: int,
    p: int,
    workers: int,
    unit: int,
) -> int:
    """The workers of `cls` (among `workers`) whose unit accepts position p = (i+1)*unit."""
    block = cls.block_size
    if cls.rule is Rule.STATE:
        if not cls.fine and p % block:
            return 0
        for s in cls.slots:
            workers &= decode(vals[s][i])
        return workers
    if p % block:
        return 0
    step = block // unit
    j = i
    for _ in range(min(cls.need, p // block)):
        for s in cls.slots:
            workers &= decode(vals[s][j])
        if not workers:
            return 0
        j -= step
    return workers


def score_fast(
    plan: Plan, slots: list[dict[int, int]], keys: Sequence[int], n_tokens: int, unit: int
) -> list[tuple[int, int]]:
    """(reusable tokens, workers) for the plan's bitset-path workers; workers not listed
    reuse 0."""
    cap = n_tokens - 1
    if cap <= 0 or not plan.fast:
        return []
    bounds = full_bounds(plan, slots, keys, cap, unit)
    sparse = plan.sparse_mask
    answers = [(f, w & ~sparse) for f, w in bounds if f > 0 and w & ~sparse]
    if not sparse:
        return answers
    pending_events = sorted(((f, w & sparse) for f, w in bounds if w & sparse), reverse=True)
    if not pending_events or pending_events[0][0] <= 0:
        return answers
    top = min(len(keys), pending_events[0][0] // unit)
    used = sorted({s for cls in plan.sparse for s in cls.slots})
    vals: dict[int, list[int | None]] = {}
    positions: set[int] = set()
    window = keys[:top]
    for s in used:
        vals[s] = list(map(slots[s].get, window))
        positions.update(compress(range(top), vals[s]))
    pending = 0
    for _, w in pending_events:
        pending |= w
    active = 0
    ptr = 0
    n_events = len(pending_events)
    for i in sorted(positions, reverse=True):
        p = (i + 1) * unit
        while ptr < n_events and pending_events[ptr][0] >= p:
            active |= pending_events[ptr][1]
            ptr += 1
        x = active & pending
        if not x:
            continue
        aligned = 0
        for alignment, mask in plan.alignments:
            if p % alignment == 0:
                aligned |= mask
        x &= aligned
        for cls in plan.sparse:
            if not x:
                break
            mine = x & cls.mask
            if mine:
                accepted = _accept(cls, vals, i, p, mine, unit)
                if accepted != mine:
                    x = (x & cls.notmask) | accepted
        if x:
            answers.append((p, x))
            pending ^= x
            if not pending:
                break
    return answers
