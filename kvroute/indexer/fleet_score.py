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

Lookups and the running AND of step 1 run inside C builtins (`map`,
`accumulate`, `compress`) in chunks that stop once nobody is covered. The work is
proportional to the prompt plus the number of distinct answers, not to prompt x
workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, compress, islice, repeat
from operator import and_, ne

from kvroute.indexer.layout import Rule
from kvroute.indexer.plan import FullWalk, Plan, SparseClass

_FIRST_CHUNK = 16  # blocks looked up at once in the coverage walk (doubling)
_MAX_CHUNK = 256  # a chunk where workers drop out is walked element by element


def lookup(
    slots: list[dict[int, int]], unit_slots: tuple[int, ...], keys: Sequence[int]
) -> list[int]:
    """Bitsets of the workers holding each key in every one of `unit_slots`."""
    out = list(map(slots[unit_slots[0]].get, keys, repeat(0)))
    for s in unit_slots[1:]:
        out = list(map(and_, out, map(slots[s].get, keys, repeat(0))))
    return out


def coverage(
    walk: FullWalk,
    slots: list[dict[int, int]],
    keys: Sequence[int],
    m: int,
    unit: int,
) -> list[tuple[int, int]]:
    """(coverage in tokens, workers) for the walk's workers, coverage ascending. Coverage
    counts whole blocks from token 0 that end at or before position m * unit."""
    block = walk.block_size
    step = block // unit
    alive = walk.mask
    events: list[tuple[int, int]] = []
    covered = 0
    pos = step - 1
    chunk = _FIRST_CHUNK
    get = slots[walk.slots[0]].get
    while alive and pos < m:
        chunk_keys = keys[pos:m:step][:chunk]
        n = len(chunk_keys)
        # most chunks lose nobody: the few distinct (interned) holder sets tell
        survivors = alive
        if len(walk.slots) == 1:
            for holders in set(map(get, chunk_keys, repeat(0))):
                survivors &= holders
        if len(walk.slots) > 1 or survivors != alive:
            bits = lookup(slots, walk.slots, chunk_keys)
            acc = list(accumulate(bits, and_, initial=alive))
            for i in compress(range(n), map(ne, acc, islice(acc, 1, None))):
                events.append((covered + i * block, acc[i] ^ acc[i + 1]))
            alive = acc[-1]
        covered += n * block
        pos += n * step
        chunk = min(chunk * 2, _MAX_CHUNK)
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


def _bits(slots: list[dict[int, int]], unit_slots: tuple[int, ...], key: int) -> int:
    bits = -1
    for s in unit_slots:
        bits &= slots[s].get(key, 0)
    return bits


def full_bounds(
    plan: Plan,
    slots: list[dict[int, int]],
    keys: Sequence[int],
    cap: int,
    unit: int,
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
                    if workers & mask:
                        out += _partial_extension(
                            walk, slots, keys, cap, unit, alignment, covered, workers & mask
                        )
    if plan.nofull_mask:
        out.append((cap, plan.nofull_mask))
    return out


def _partial_extension(
    walk: FullWalk,
    slots: list[dict[int, int]],
    keys: Sequence[int],
    cap: int,
    unit: int,
    alignment: int,
    covered: int,
    workers: int,
) -> list[tuple[int, int]]:
    """Fine-grained mode: (bound, workers) for `workers`, whose coverage ends at `covered`,
    each extended by the highest partial entry inside the first uncovered block."""
    out: list[tuple[int, int]] = []
    top = min(covered + walk.block_size - alignment, cap - cap % alignment)
    for p in range(top, covered, -alignment):
        hit = workers & _bits(slots, walk.slots, keys[p // unit - 1])
        if hit:
            out.append((p, hit))
            workers ^= hit
            if not workers:
                return out
    out.append((covered, workers))
    return out


class _LazyBits:
    """Holders per key index of one unit, looked up on first use (for windows, when the
    candidates come from Mamba states and only a few windows are ever checked)."""

    __slots__ = ("_cache", "_keys", "_slots", "_unit_slots")

    def __init__(
        self, slots: list[dict[int, int]], unit_slots: tuple[int, ...], keys: Sequence[int]
    ) -> None:
        self._slots = slots
        self._unit_slots = unit_slots
        self._keys = keys
        self._cache: dict[int, int] = {}

    def __getitem__(self, i: int) -> int:
        bits = self._cache.get(i)
        if bits is None:
            bits = _bits(self._slots, self._unit_slots, self._keys[i])
            self._cache[i] = bits
        return bits


def _accept(
    cls: SparseClass, bits: list[int] | _LazyBits, i: int, p: int, workers: int, unit: int
) -> int:
    """The workers of `cls` (among `workers`) whose unit accepts p = (i+1)*unit; `bits`
    are the unit's holders per key index."""
    block = cls.block_size
    if cls.rule is Rule.STATE:
        if not cls.fine and p % block:
            return 0
        return workers & bits[i]
    if p % block:
        return 0
    step = block // unit
    need = min(cls.need, p // block)
    # the blocks at both ends of the window first: inside a run that does not reach
    # back far enough, the far end fails at once
    workers &= bits[i] & bits[i - (need - 1) * step]
    j = i - step
    for _ in range(need - 2):
        if not workers:
            return 0
        workers &= bits[j]
        j -= step
    return workers


def score_fast(
    plan: Plan,
    slots: list[dict[int, int]],
    keys: Sequence[int],
    n_tokens: int,
    unit: int,
    bounds: list[tuple[int, int]] | None = None,
) -> list[tuple[int, int]]:
    """(reusable tokens, workers) for the plan's bitset-path workers; workers not listed
    reuse 0. `bounds`, when given, is what `full_bounds` returned for the same request."""
    cap = n_tokens - 1
    if cap <= 0 or not plan.fast:
        return []
    if bounds is None:
        bounds = full_bounds(plan, slots, keys, cap, unit)
    sparse = plan.sparse_mask
    answers = [(f, w & ~sparse) for f, w in bounds if f > 0 and w & ~sparse]
    if not sparse:
        return answers
    pending_events = sorted(((f, w & sparse) for f, w in bounds if w & sparse), reverse=True)
    if not pending_events or pending_events[0][0] <= 0:
        return answers
    top = min(len(keys), pending_events[0][0] // unit)
    window = keys[:top]
    # Candidates: positions where a unit holds the request's key. When every sparse
    # worker has a Mamba unit, its states alone are the candidates and windows are
    # looked up lazily.
    state_mask = 0
    for cls in plan.sparse:
        if cls.rule is Rule.STATE:
            state_mask |= cls.mask
    states_only = sparse & ~state_mask == 0
    unit_bits: list[list[int] | _LazyBits] = []
    positions: set[int] = set()
    for cls in plan.sparse:
        if states_only and cls.rule is Rule.WINDOW:
            unit_bits.append(_LazyBits(slots, cls.slots, keys))
            continue
        bits = lookup(slots, cls.slots, window)
        unit_bits.append(bits)
        positions.update(compress(range(top), bits))
    pending = 0
    for _, w in pending_events:
        pending |= w
    active = 0
    ptr = 0
    n_events = len(pending_events)
    classes = list(zip(plan.sparse, unit_bits, strict=True))
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
        for cls, holders in classes:
            if not x:
                break
            mine = x & cls.mask
            if mine:
                accepted = _accept(cls, holders, i, p, mine, unit)
                if accepted != mine:
                    x = (x & cls.notmask) | accepted
        if x:
            answers.append((p, x))
            pending ^= x
            if not pending:
                break
    return answers
