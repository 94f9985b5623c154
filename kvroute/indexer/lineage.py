"""One worker's view of its KV cache, rebuilt from group events: the one place that owns
positions, lineage and copies.

vLLM's events never state where a block sits. The view learns it from parent links and
token spans:

- one map from engine hash to content key (which carries the position), shared by all
  groups, because a hash names the same prefix boundary in every group;
- positions come only from dense reports (hashes x block size == token span): the span
  is cut into blocks, chained from the parent's key (or the namespace seed at token 0);
- sparse reports (fewer hashes than the span: sliding-window and Mamba groups) are never
  sliced; their hashes wait as pending until a dense report of the same hash resolves
  them. A dense report whose parent is unknown waits for the parent's position (never
  treated as a root) and resolves with it, cascading to its own children;
- copies are counted per (group, hash): STORE adds one, REMOVE withdraws one;
- what a block was cached under (LoRA name, cache salt) is the event's where set,
  otherwise the parent's; blocks marked unmatchable (and their descendants) keep their
  positions for lineage but never match;
- a snapshot's `lineage` reports are dense reports that give positions only (no copies,
  no group declared): applied before its events, they place blocks whose ancestors the
  engine no longer holds, and are released with the rest of unheld history.

Presence of matchable blocks is kept by a `PresenceSink` (a dict per group for one
worker, or the fleet's inverted index), keyed by content key. History is released at
the end of each batch once no group holds it; a cap on retained entries evicts the
deepest positions first (a lower score, never a wrong one) and pending reports are
bounded.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import compress, islice
from typing import Protocol

from kvroute.indexer.keys import (
    DEFAULT_NAMESPACE,
    MASK64,
    Namespace,
    chain_keys,
    namespace_seed,
    tokens_to_bytes,
)
from kvroute.indexer.layout import GroupSpec, Layout, build_layout
from kvroute.proto import events_pb2

_STORE = events_pb2.KvGroupEvent.STORE
_REMOVE = events_pb2.KvGroupEvent.REMOVE
_CLEAR = events_pb2.KvGroupEvent.CLEAR


class Conflict(Exception):
    """Evidence that contradicts the view: the view is discarded."""


class Malformed(Exception):
    """An event the indexer cannot interpret: handled like INVALID."""


class PresenceSink(Protocol):
    """Where a worker's matchable blocks are recorded, per group slot and content key.
    Counts copies; `discard` withdraws one copy and says whether one was held."""

    def add_slot(self, slot: int) -> None: ...
    def add(self, slot: int, key: int) -> None: ...
    def discard(self, slot: int, key: int) -> bool: ...
    def discard_all(self, slot: int, keys: list[int]) -> list[bool]: ...
    def add_all(self, slot: int, keys: list[int]) -> None: ...
    def holds(self, key: int) -> bool: ...
    def holds_all(self, keys: list[int]) -> list[bool]: ...
    def drop(self, key: int) -> None: ...
    def clear(self, keys: Iterable[int]) -> None: ...
    def present(self, slot: int) -> int: ...


@dataclass(slots=True)
class _Group:
    group_id: int
    slot: int
    kind: str
    window: int
    block_size: int


@dataclass(slots=True, frozen=True)
class _Wait:
    """A dense block whose parent's position is not known yet."""

    block_hash: bytes
    data: bytes  # its tokens as uint32 bytes
    lora_name: str
    cache_salt: str
    unmatchable: bool


@dataclass(slots=True, frozen=True)
class _Base:
    """A known boundary to chain from: position (tokens), chain value, matchable, namespace."""

    tokens: int
    seed: int
    matchable: bool
    namespace: Namespace


class Lineage:
    """Applies one worker's group events; see the module docstring for the rules."""

    def __init__(
        self, sink: PresenceSink, hash_unit: int, max_entries: int, max_pending: int
    ) -> None:
        if max_entries < 1 or max_pending < 1:
            raise ValueError("caps must be positive")
        self._sink = sink
        self._unit = hash_unit
        self._max_entries = max_entries
        self._max_pending = max_pending
        self._groups: dict[int, _Group] = {}
        self._unit_gcd = 0
        # Resolved matchable blocks: hash -> content key (the key also carries the
        # position, and is the very object the sink stores, so it is held once).
        self._res: dict[bytes, int] = {}
        self._unm: dict[bytes, int] = {}  # resolved, lineage only: hash -> position (tokens)
        self._ns: dict[bytes, Namespace] = {}  # resolved matchable outside the default ns
        self._xcopies: list[dict[bytes, int]] = []  # per slot: copies of unm/pending hashes
        self._pend: dict[bytes, bytes | None] = {}  # unresolved hash -> parent it waits on
        self._waiting: dict[bytes, list[_Wait]] = {}  # parent hash -> blocks waiting on it
        self._candidates: set[bytes] = set()  # release candidates at the end of the batch
        self._cleared = False
        self._override: int | None = None
        self._layout: Layout | None = None
        self.layout_version = 0
        self.evicted = 0
        self.pending_evicted = 0
        self.resets = 0
        self.conflicts = 0
        self.invalid = 0
        self.malformed = 0

    # -- queries -------------------------------------------------------------------------

    @property
    def entries(self) -> int:
        """Retained blocks with a known position."""
        return len(self._res) + len(self._unm)

    @property
    def pending(self) -> int:
        """Blocks whose position is not known yet."""
        return len(self._pend)

    def layout(self) -> Layout:
        if self._layout is None:
            groups = tuple(
                GroupSpec(g.group_id, g.slot, g.kind, g.block_size, g.window)
                for g in self._groups.values()
            )
            self._layout = build_layout(groups, self._unit_gcd, self._unit, self._override)
        return self._layout

    def set_alignment(self, alignment: int | None) -> None:
        self._override = alignment
        self._changed()

    def blocks_per_group(self) -> dict[int, int]:
        """Distinct blocks each group holds (matchable ones by content key, lineage-only
        and pending ones by hash)."""
        return {
            g.group_id: self._sink.present(g.slot) + len(self._xcopies[g.slot])
            for g in self._groups.values()
        }

    def content_key(self, block_hash: bytes) -> int | None:
        """The content key of a resolved matchable block."""
        return self._res.get(block_hash)

    def keys(self) -> Iterable[int]:
        """Content keys of every resolved matchable block."""
        return self._res.values()

    # -- batches -------------------------------------------------------------------------

    def apply_batch(
        self,
        events: Sequence[events_pb2.KvGroupEvent],
        lineage: Sequence[events_pb2.KvGroupEvent] = (),
    ) -> None:
        """Apply one batch in order; history is released only at the end of the batch.

        `lineage` (a snapshot's) is applied first, as positions only.
        """
        self.apply_events(events, lineage)
        self.end_batch()

    def apply_events(
        self,
        events: Sequence[events_pb2.KvGroupEvent],
        lineage: Sequence[events_pb2.KvGroupEvent] = (),
    ) -> None:
        """`apply_batch` without its end: a batch applied in several calls, then
        `end_batch` (the same result as one call)."""
        for event in lineage:
            self._guarded(self._place, event)
        # Most events of a busy engine are REMOVEs of one hash each. A run of them in one
        # group is applied as one list (in order, so the result is the same): a REMOVE never
        # raises and never grows the view, so it needs neither the guard nor the caps check.
        run: list[bytes] = []
        run_group = 0
        for event in events:
            if event.operation == _REMOVE:
                group = event.group_id
                if run and group != run_group:
                    self._remove_run(run_group, run)
                    run = []
                run_group = group
                run.extend(event.block_hashes)
                continue
            if run:
                self._remove_run(run_group, run)
                run = []
            self._guarded(self._apply, event)
        if run:
            self._remove_run(run_group, run)

    def end_batch(self) -> None:
        """End a batch: release history no reported block and no pending report needs."""
        self._release()

    def _guarded(
        self,
        apply: Callable[[events_pb2.KvGroupEvent], None],
        event: events_pb2.KvGroupEvent,
    ) -> None:
        try:
            apply(event)
        except Conflict:
            self.conflicts += 1
            self.discard()
            try:  # the event that conflicted is new evidence for a fresh view
                apply(event)
            except (Conflict, Malformed):
                self.discard()
        except Malformed:
            self.malformed += 1
            self.discard()
        self._enforce_caps()

    def discard(self, *, counted: bool = True) -> None:
        """Forget everything, groups included (a gap, INVALID, conflict or lost stream;
        `counted=False` for a snapshot replacing the view)."""
        self._sink.clear(list(self._res.values()))
        self._groups.clear()
        self._unit_gcd = 0
        self._res.clear()
        self._unm.clear()
        self._ns.clear()
        self._xcopies.clear()
        self._pend.clear()
        self._waiting.clear()
        self._candidates.clear()
        self._cleared = False
        self.resets += counted
        self._changed()

    def _changed(self) -> None:
        self._layout = None
        self.layout_version += 1

    def _apply(self, e: events_pb2.KvGroupEvent) -> None:
        op = e.operation
        if op == _STORE:
            self._store(e)
        elif op == _REMOVE:
            self._remove(e)
        elif op == _CLEAR:
            self._clear()
        else:  # INVALID, or an operation this version does not know
            self.invalid += 1
            self.discard()

    # -- groups --------------------------------------------------------------------------

    def _declare(self, e: events_pb2.KvGroupEvent) -> _Group:
        bs = e.block_size
        if bs <= 0:
            raise Malformed("store without a block size")
        g = self._groups.get(e.group_id)
        if g is None:
            g = _Group(e.group_id, len(self._groups), e.kind, e.sliding_window, bs)
            self._groups[e.group_id] = g
            self._xcopies.append({})
            self._sink.add_slot(g.slot)
            self._changed()
        elif g.kind != e.kind or g.window != e.sliding_window:
            raise Conflict(f"group {e.group_id} changed kind or window")
        elif bs > g.block_size:
            g.block_size = bs  # the physical block size is the largest seen
            self._changed()
        unit_gcd = math.gcd(self._unit_gcd, bs)
        if unit_gcd != self._unit_gcd:
            self._unit_gcd = unit_gcd
            self._changed()
        return g

    # -- lineage (positions only) ----------------------------------------------------------

    def _place(self, e: events_pb2.KvGroupEvent) -> None:
        """A dense report that places its blocks but adds no copy; sparse ones say nothing."""
        if e.operation != _STORE:
            raise Malformed("lineage holds STOREs only")
        if e.block_size <= 0:
            raise Malformed("store without a block size")
        hashes = list(e.block_hashes)
        if not all(hashes):
            raise Malformed("empty block hash")
        if hashes and len(e.token_ids) == len(hashes) * e.block_size:
            self._store_dense(None, hashes, e)
            self._candidates.update(hashes)  # released at the end unless a group holds them

    # -- STORE ---------------------------------------------------------------------------

    def _store(self, e: events_pb2.KvGroupEvent) -> None:
        g = self._declare(e)
        hashes = list(e.block_hashes)
        if not hashes:
            return  # declares the group, holds nothing
        if not all(hashes):
            raise Malformed("empty block hash")
        slot = g.slot
        if len(e.token_ids) == len(hashes) * e.block_size:
            self._store_dense(slot, hashes, e)
        else:  # sparse: never sliced by ordinal
            for h in hashes:
                self._add_copy(slot, h)

    def _add_copy(self, slot: int, h: bytes) -> None:
        key = self._res.get(h)
        if key is not None:
            self._sink.add(slot, key)
            return
        if h not in self._unm and h not in self._pend:
            self._pend[h] = None  # waits for a dense report of h
        xc = self._xcopies[slot]
        xc[h] = xc.get(h, 0) + 1

    def _base(self, h: bytes, lora_name: str, cache_salt: str, unmatchable: bool) -> _Base | None:
        """The boundary a child of `h` chains from, or None while h's position is unknown."""
        key = self._res.get(h)
        if key is not None:
            ns = self._ns.get(h, DEFAULT_NAMESPACE)
            # A child that names a namespace other than its parent's cannot be keyed
            # (its chain is not the parent's): lineage only.
            clash = bool(
                (lora_name and lora_name != ns.lora_name)
                or (cache_salt and cache_salt != ns.cache_salt)
            )
            return _Base((key >> 64) * self._unit, key & MASK64, not (unmatchable or clash), ns)
        tokens = self._unm.get(h)
        if tokens is not None:
            return _Base(tokens, 0, False, DEFAULT_NAMESPACE)
        return None

    @staticmethod
    def _root(lora_name: str, cache_salt: str, unmatchable: bool) -> _Base:
        ns = Namespace(lora_name, cache_salt) if lora_name or cache_salt else DEFAULT_NAMESPACE
        return _Base(0, namespace_seed(ns), not unmatchable, ns)

    def _store_dense(
        self, slot: int | None, hashes: list[bytes], e: events_pb2.KvGroupEvent
    ) -> None:
        """Place a dense report's blocks; `slot` None: positions only (lineage)."""
        bs = e.block_size
        unit = self._unit
        lora, salt = e.lora_name, e.cache_namespace
        unmatchable = e.unmatchable or bs % unit != 0  # unkeyable sizes: lineage only
        parent = e.parent_block_hash
        if parent:
            base = self._base(parent, lora, salt, unmatchable)
        else:
            base = self._root(lora, salt, unmatchable)
        data = tokens_to_bytes(e.token_ids[:])
        width = bs * 4
        step = bs // unit
        if base is not None and base.matchable:
            self._store_keyed(
                slot,
                hashes,
                base,
                chain_keys(data, base.tokens // unit, base.seed, unit)[step - 1 :: step],
            )
            return
        base_j = 0  # the index of the first block after `base`
        keys: list[int] | None = None
        prev = parent
        for j, h in enumerate(hashes):
            if base is None:
                known = self._base(h, lora, salt, unmatchable)
                if known is None:
                    self._wait(prev, h, data[j * width : (j + 1) * width], lora, salt, unmatchable)
                else:  # h is known from elsewhere: the following blocks chain from it
                    base, base_j, keys = known, j + 1, None
            else:
                offset = j - base_j + 1
                if base.matchable:
                    if keys is None:
                        rest = data[base_j * width :]
                        keys = chain_keys(rest, base.tokens // unit, base.seed, unit)
                    if self._resolve(h, keys[offset * step - 1], base.namespace):
                        self._cascade(h)
                else:
                    if self._resolve_unmatchable(h, base.tokens + offset * bs):
                        self._cascade(h)
                    if h in self._res:  # h is matchable by another report: chain from it
                        base, base_j, keys = self._base(h, lora, salt, unmatchable), j + 1, None
            if slot is not None:
                self._add_copy(slot, h)
            prev = h

    def _store_keyed(
        self, slot: int | None, hashes: list[bytes], base: _Base, block_keys: list[int]
    ) -> None:
        """The common case of a dense store: every block's content key is known."""
        res, unm, pend, waiting = self._res, self._unm, self._pend, self._waiting
        ns = base.namespace
        olds = list(map(res.get, hashes))
        if (
            olds.count(None) == len(olds)
            and not (unm or pend or waiting)
            and len(set(hashes)) == len(hashes)
        ):  # the usual store: new blocks, nothing waiting on them
            res.update(zip(hashes, block_keys, strict=True))
            if ns is not DEFAULT_NAMESPACE:
                self._ns.update(dict.fromkeys(hashes, ns))
        else:
            for h, key in zip(hashes, block_keys, strict=True):
                old = res.get(h)  # not olds: an earlier block of this store may be h
                if old is None:
                    if h in unm or h in pend:
                        self._resolve(h, key, ns)
                    else:
                        res[h] = key
                        if ns is not DEFAULT_NAMESPACE:
                            self._ns[h] = ns
                    if h in waiting:
                        self._cascade(h)
                elif old != key:
                    raise Conflict("a hash learned with different content or position")
        # presence after every key is in the view: a conflict above discards the view by
        # its keys, and must find no presence without one
        if slot is not None:
            self._sink.add_all(slot, block_keys)

    def _wait(
        self, parent: bytes, h: bytes, data: bytes, lora: str, salt: str, unmatchable: bool
    ) -> None:
        """Park a dense block until its parent's position is known."""
        if h in self._res or h in self._unm or self._pend.get(h):
            return  # known, or already waiting (a duplicate report): keep the first
        self._pend[h] = parent
        self._waiting.setdefault(parent, []).append(_Wait(h, data, lora, salt, unmatchable))

    def _resolve(self, h: bytes, key: int, ns: Namespace) -> bool:
        """Learn that h is matchable with content `key`; True if h was not resolved."""
        old = self._res.get(h)
        if old is not None:
            if old != key:
                raise Conflict("a hash learned with different content or position")
            return False
        tokens = self._unm.pop(h, None)
        if tokens is not None and tokens != (key >> 64) * self._unit:
            raise Conflict("a hash learned at two positions")
        self._res[h] = key
        if ns is not DEFAULT_NAMESPACE:
            self._ns[h] = ns
        self._unpend(h)
        for slot, xc in enumerate(self._xcopies):  # copies counted so far become presence
            for _ in range(xc.pop(h, 0)):
                self._sink.add(slot, key)
        return tokens is None

    def _resolve_unmatchable(self, h: bytes, tokens: int) -> bool:
        """Learn h's position without a usable content key; True if h was not resolved."""
        key = self._res.get(h)
        if key is not None:
            if (key >> 64) * self._unit != tokens:
                raise Conflict("a hash learned at two positions")
            return False
        old = self._unm.get(h)
        if old is not None:
            if old != tokens:
                raise Conflict("a hash learned at two positions")
            return False
        self._unm[h] = tokens
        self._unpend(h)
        return True

    def _unpend(self, h: bytes) -> None:
        if h in self._pend:
            parent = self._pend.pop(h)
            if parent:
                self._drop_wait(parent, h)

    def _drop_wait(self, parent: bytes, h: bytes) -> None:
        waits = self._waiting.get(parent)
        if waits is None:
            return
        waits[:] = [w for w in waits if w.block_hash != h]
        if not waits:
            del self._waiting[parent]

    def _cascade(self, h: bytes) -> None:
        """Resolve the blocks that waited for h's position, and theirs (iteratively)."""
        stack = [h]
        while stack:
            parent = stack.pop()
            waits = self._waiting.pop(parent, None)
            if not waits:
                continue
            for w in waits:
                child = w.block_hash
                if self._pend.get(child) != parent:
                    continue
                del self._pend[child]
                base = self._base(parent, w.lora_name, w.cache_salt, w.unmatchable)
                assert base is not None  # the parent was just resolved
                bs = len(w.data) // 4
                if base.matchable and bs % self._unit == 0:
                    key = chain_keys(w.data, base.tokens // self._unit, base.seed, self._unit)
                    self._resolve(child, key[-1], base.namespace)
                else:
                    self._resolve_unmatchable(child, base.tokens + bs)
                self._candidates.add(child)  # it may hold nothing by now
                stack.append(child)

    # -- REMOVE / CLEAR ------------------------------------------------------------------

    def _remove(self, e: events_pb2.KvGroupEvent) -> None:
        self._remove_run(e.group_id, list(e.block_hashes))

    def _remove_run(self, group_id: int, hashes: list[bytes]) -> None:
        """Withdraw one copy of each hash from the group, in order."""
        g = self._groups.get(group_id)
        if g is None:
            return  # nothing of that group is held
        slot = g.slot
        keys = list(map(self._res.get, hashes))
        if None not in keys:  # the common case: every hash resolved and matchable
            done = self._sink.discard_all(slot, keys)  # type: ignore[arg-type]
            self._candidates.update(compress(hashes, done))
            return
        for h, key in zip(hashes, keys, strict=True):
            if key is not None:
                if self._sink.discard(slot, key):
                    self._candidates.add(h)
                continue
            xc = self._xcopies[slot]
            n = xc.get(h)
            if n:
                if n == 1:
                    del xc[h]
                else:
                    xc[h] = n - 1
                self._candidates.add(h)

    def _clear(self) -> None:
        """Every group empties but stays known: the worker then scores 0, not None."""
        self._sink.clear(list(self._res.values()))
        for xc in self._xcopies:
            xc.clear()
        self._pend.clear()
        self._waiting.clear()
        self._cleared = True

    # -- end of batch ----------------------------------------------------------------------

    def _held(self, h: bytes) -> bool:
        return any(h in xc for xc in self._xcopies)

    def _release(self) -> None:
        """Release history no reported block and no pending report needs."""
        if self._cleared:
            candidates = list(dict.fromkeys([*self._res, *self._unm, *self._candidates]))
            self._cleared = False
        else:
            candidates = list(self._candidates)
        self._candidates.clear()
        res = self._res
        keys = list(map(res.get, candidates))
        if None not in keys:  # the common case: resolved matchable blocks only, in bulk
            held = self._sink.holds_all(keys)  # type: ignore[arg-type]
            for h, kept in zip(candidates, held, strict=True):
                if not kept:
                    del res[h]
            if self._ns:
                for h in compress(candidates, [not kept for kept in held]):
                    self._ns.pop(h, None)
            return
        for h, key in zip(candidates, keys, strict=True):
            if key is not None:
                if not self._sink.holds(key):
                    del res[h]
                    self._ns.pop(h, None)
            elif h in self._unm:
                if not self._held(h):
                    del self._unm[h]
            else:
                self._release_pending(h)

    def _release_pending(self, h: bytes) -> None:
        while h in self._pend and not self._held(h) and not self._waiting.get(h):
            parent = self._pend.pop(h)
            if not parent:
                return
            self._drop_wait(parent, h)
            h = parent  # the parent may have been kept only for this child

    # -- caps ------------------------------------------------------------------------------

    def _enforce_caps(self) -> None:
        if len(self._res) + len(self._unm) > self._max_entries:
            self._evict_entries()
        if len(self._pend) > self._max_pending:
            self._evict_pending()

    def _evict_entries(self) -> None:
        """Evict the deepest positions first, down to 7/8 of the cap: a lower score for
        long prefixes, while shallow shared prefixes (system prompts) survive."""
        keep = self._max_entries - self._max_entries // 8
        excess = len(self._res) + len(self._unm) - keep
        unit = self._unit
        depth: Counter[int] = Counter((key >> 64) * unit for key in self._res.values())
        depth.update(self._unm.values())
        threshold, at_threshold = 0, 0
        for tokens in sorted(depth, reverse=True):
            if excess <= depth[tokens]:
                threshold, at_threshold = tokens, excess
                break
            excess -= depth[tokens]

        def victim(tokens: int) -> bool:
            nonlocal at_threshold
            if tokens > threshold:
                return True
            if tokens == threshold and at_threshold > 0:
                at_threshold -= 1
                return True
            return False

        victims_res = [h for h, key in self._res.items() if victim((key >> 64) * unit)]
        victims_unm = [h for h, tokens in self._unm.items() if victim(tokens)]
        for h in victims_res:
            self._sink.drop(self._res.pop(h))
            self._ns.pop(h, None)
        for h in victims_unm:
            del self._unm[h]
            for xc in self._xcopies:
                xc.pop(h, None)
        self.evicted += len(victims_res) + len(victims_unm)

    def _evict_pending(self) -> None:
        """Drop the oldest pending reports, down to 7/8 of the cap."""
        keep = self._max_pending - self._max_pending // 8
        victims = list(islice(self._pend, len(self._pend) - keep))
        for h in victims:
            parent = self._pend.pop(h)
            if parent:
                self._drop_wait(parent, h)
            for xc in self._xcopies:
                xc.pop(h, None)
        self.pending_evicted += len(victims)
