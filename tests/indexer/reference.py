"""A brute-force reference of the indexer's semantics, for property tests.

Written to be obviously correct rather than fast, and independently of `indexer`: no
content keys, no bitsets, no caps. A block's identity is its namespace plus the tuple of
every token from 0 to its end; a group holds content at position p when one of its
hashes with copies > 0 has exactly that identity. Scoring tries every token position.

Event semantics (the contract the indexer implements):
- batches apply in sequence order; a stale sequence is ignored; a gap discards the view
  (groups too) and then applies the batch; INVALID and malformed events discard it;
  contradicting evidence (a group's kind or window changes; a hash seen at two positions
  or with different content) discards it and the event is applied to the fresh view;
- STORE adds a copy of each (group, hash); REMOVE withdraws one; CLEAR empties every
  group but keeps the groups;
- dense stores (hashes x block size == tokens) give positions, chained from the parent
  (or token 0); a dense store with an unknown parent waits, per block, until the parent
  is known; sparse stores never give positions;
- a block's namespace is its event's (lora_name, cache_salt) at token 0, else the
  parent's; a child naming a different lora/salt than its parent, an unmatchable event,
  a block size that is not a multiple of the hash unit, or an unmatchable parent make
  the block lineage-only;
- at the end of a batch, known blocks no group holds are forgotten, and so are pending
  blocks no group holds and no pending block waits on;
- a snapshot's lineage reports, applied before its events, are dense stores that give
  positions only (no copies, no group declared).

Hit rule (vLLM's coordinator): groups with equal (kind, block size, window) form a unit;
full-attention units, in group order, each cut the cap in turn (contiguous blocks from 0,
plus a partial entry inside the first missing block in fine-grained mode); then the hit
is the largest aligned position up to that bound every other unit accepts: a sliding
window needs the blocks covering max(0, p - need*B)..p, Mamba a state exactly at p.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvroute.proto import events_pb2 as pb

FULL_KINDS = {"full_attention", "mla_attention", "sink_full_attention"}
WINDOW_KINDS = {"sliding_window", "sliding_window_mla"}
STATE_KINDS = {"mamba"}
DEFAULT_NS = ("", "")


class _Conflict(Exception):
    pass


class _Malformed(Exception):
    pass


@dataclass
class _Info:
    end: int
    matchable: bool
    ns: tuple[str, str]
    prefix: tuple[int, ...]  # tokens [0, end) when matchable


@dataclass
class _Wait:
    parent: bytes
    tokens: tuple[int, ...]
    block_size: int
    lora: str
    salt: str
    unmatchable: bool


@dataclass
class _Group:
    kind: str
    window: int
    block_size: int


@dataclass
class RefWorker:
    """One worker, unbounded."""

    hash_unit: int = 16
    alignment_override: int | None = None
    last_sequence: int | None = None
    groups: dict[int, _Group] = field(default_factory=dict)
    sizes: set[int] = field(default_factory=set)
    copies: dict[tuple[int, bytes], int] = field(default_factory=dict)
    info: dict[bytes, _Info] = field(default_factory=dict)
    waits: dict[bytes, _Wait] = field(default_factory=dict)  # pending hash -> its record
    pending: dict[bytes, None] = field(default_factory=dict)  # unresolved hashes (ordered)

    # -- stream ------------------------------------------------------------------------

    def apply(self, batch: pb.KvEventBatch) -> None:
        if self.last_sequence is not None:
            if batch.sequence <= self.last_sequence:
                return
            if batch.sequence != self.last_sequence + 1:
                self.discard()
        self._batch(batch.events)
        self.last_sequence = batch.sequence

    def apply_snapshot(self, snap: pb.Snapshot) -> None:
        self.discard()
        self._batch(snap.events, snap.lineage)
        self.last_sequence = snap.sequence if snap.has_sequence else None

    def invalidate(self) -> None:
        self.discard()
        self.last_sequence = None

    def discard(self) -> None:
        self.groups.clear()
        self.sizes.clear()
        self.copies.clear()
        self.info.clear()
        self.waits.clear()
        self.pending.clear()

    def _batch(
        self, events: Sequence[pb.KvGroupEvent], lineage: Sequence[pb.KvGroupEvent] = ()
    ) -> None:
        steps = [(self._place, e) for e in lineage] + [(self._event, e) for e in events]
        for apply, e in steps:
            try:
                apply(e)
            except _Conflict:
                self.discard()
                try:
                    apply(e)
                except (_Conflict, _Malformed):
                    self.discard()
            except _Malformed:
                self.discard()
        self._sweep()

    def _place(self, e: pb.KvGroupEvent) -> None:
        """A snapshot's lineage report: positions from a dense STORE, no copies, no group."""
        if e.operation != pb.KvGroupEvent.STORE or e.block_size <= 0 or not all(e.block_hashes):
            raise _Malformed
        hashes, tokens = list(e.block_hashes), tuple(e.token_ids)
        if hashes and len(tokens) == len(hashes) * e.block_size:
            self._dense(e, hashes, tokens)

    def _event(self, e: pb.KvGroupEvent) -> None:
        if e.operation == pb.KvGroupEvent.STORE:
            self._store(e)
        elif e.operation == pb.KvGroupEvent.REMOVE:
            if e.group_id in self.groups:
                for h in e.block_hashes:
                    n = self.copies.get((e.group_id, h), 0)
                    if n:
                        self.copies[e.group_id, h] = n - 1
        elif e.operation == pb.KvGroupEvent.CLEAR:
            self.copies.clear()
            self.waits.clear()
            self.pending.clear()
        else:
            self.discard()

    def _held(self, h: bytes) -> bool:
        return any(n > 0 and hh == h for (_, hh), n in self.copies.items())

    def _sweep(self) -> None:
        for h in list(self.info):
            if not self._held(h):
                del self.info[h]
        changed = True
        while changed:
            changed = False
            for h in list(self.pending):
                waited_on = any(w.parent == h for w in self.waits.values())
                if not self._held(h) and not waited_on:
                    del self.pending[h]
                    self.waits.pop(h, None)
                    changed = True

    # -- STORE -------------------------------------------------------------------------

    def _store(self, e: pb.KvGroupEvent) -> None:
        bs = e.block_size
        if bs <= 0:
            raise _Malformed
        g = self.groups.get(e.group_id)
        if g is None:
            self.groups[e.group_id] = _Group(e.kind, e.sliding_window, bs)
        elif (g.kind, g.window) != (e.kind, e.sliding_window):
            raise _Conflict
        else:
            g.block_size = max(g.block_size, bs)
        self.sizes.add(bs)
        hashes = list(e.block_hashes)
        if not hashes:
            return
        if not all(hashes):
            raise _Malformed
        tokens = tuple(e.token_ids)
        if len(tokens) == len(hashes) * bs:
            self._dense(e, hashes, tokens)
        for h in hashes:
            self.copies[e.group_id, h] = self.copies.get((e.group_id, h), 0) + 1
            if h not in self.info and h not in self.pending:
                self.pending[h] = None

    def _child(
        self, parent: bytes | None, tokens: tuple[int, ...], lora: str, salt: str, unm: bool
    ) -> _Info | None:
        """What a block with these tokens after `parent` (None: token 0) is, if known."""
        unusable = unm or len(tokens) % self.hash_unit != 0
        if parent is None:
            ns = (lora, salt)
            return _Info(len(tokens), not unusable, ns, tokens if not unusable else ())
        p = self.info.get(parent)
        if p is None:
            return None
        clash = bool((lora and lora != p.ns[0]) or (salt and salt != p.ns[1]))
        matchable = p.matchable and not unusable and not clash
        end = p.end + len(tokens)
        return _Info(end, matchable, p.ns, p.prefix + tokens if matchable else ())

    def _learn(self, h: bytes, new: _Info) -> None:
        old = self.info.get(h)
        if old is not None:
            if old.end != new.end:
                raise _Conflict
            if old.matchable and new.matchable and (old.ns, old.prefix) != (new.ns, new.prefix):
                raise _Conflict
            if not old.matchable and new.matchable:
                self.info[h] = new
            return
        self.info[h] = new
        self.pending.pop(h, None)
        self.waits.pop(h, None)
        self._cascade(h)

    def _cascade(self, h: bytes) -> None:
        for child, w in list(self.waits.items()):
            if w.parent != h or child not in self.waits:
                continue
            del self.waits[child]
            self.pending.pop(child, None)
            new = self._child(h, w.tokens, w.lora, w.salt, w.unmatchable)
            assert new is not None
            self._learn(child, new)

    def _dense(self, e: pb.KvGroupEvent, hashes: list[bytes], tokens: tuple[int, ...]) -> None:
        bs = e.block_size
        prev: bytes | None = e.parent_block_hash or None
        for j, h in enumerate(hashes):
            chunk = tokens[j * bs : (j + 1) * bs]
            new = self._child(prev, chunk, e.lora_name, e.cache_namespace, e.unmatchable)
            if new is not None:
                self._learn(h, new)
            elif h not in self.info and h not in self.waits:
                assert prev is not None
                self.waits[h] = _Wait(
                    prev, chunk, bs, e.lora_name, e.cache_namespace, e.unmatchable
                )
                self.pending[h] = None
            prev = h

    # -- scoring -----------------------------------------------------------------------

    def _rule(self, g: _Group) -> str | None:
        if g.kind in FULL_KINDS:
            return "full"
        if g.kind in WINDOW_KINDS and g.window > 0:
            return "window"
        if g.kind in STATE_KINDS:
            return "state"
        return None

    def alignment(self) -> int | None:
        """vLLM's alignment for the reported groups, or None when unusable."""
        u = self.hash_unit
        if not self.groups:
            return None
        for g in self.groups.values():
            if self._rule(g) is None or g.block_size % u:
                return None
        gcd = math.gcd(*self.sizes)
        if gcd % u:
            return None
        if self.alignment_override is not None:
            a = self.alignment_override
        elif len(self.groups) == 1:
            a = next(iter(self.groups.values())).block_size
        else:
            rules = {gid: self._rule(g) for gid, g in self.groups.items()}
            partial = any(
                rules[gid] == "state" and g.block_size > gcd for gid, g in self.groups.items()
            ) and all(
                rules[gid] in ("full", "state") or g.block_size == gcd
                for gid, g in self.groups.items()
            )
            a = gcd if partial else math.lcm(*(g.block_size for g in self.groups.values()))
        return a if a % u == 0 else None

    def holds(self, gid: int, tokens: Sequence[int], ns: tuple[str, str], p: int) -> bool:
        want = tuple(tokens[:p])
        for (g, h), n in self.copies.items():
            if g != gid or n <= 0:
                continue
            i = self.info.get(h)
            if i is not None and i.matchable and i.end == p and i.ns == ns and i.prefix == want:
                return True
        return False

    def score(self, tokens: Sequence[int], ns: tuple[str, str] = DEFAULT_NS) -> int | None:
        a = self.alignment()
        if a is None:
            return None
        cap = max(len(tokens) - 1, 0)
        units: dict[tuple[str, int, int], list[int]] = {}
        for gid in sorted(self.groups):
            g = self.groups[gid]
            units.setdefault((g.kind, g.block_size, g.window), []).append(gid)

        def held(gids: list[int], p: int) -> bool:
            return all(self.holds(gid, tokens, ns, p) for gid in gids)

        full = [(k, v) for k, v in units.items() if k[0] in FULL_KINDS]
        other = [(k, v) for k, v in units.items() if k[0] not in FULL_KINDS]
        bound = cap
        for (_, b, _), gids in full:
            covered = 0
            while covered + b <= bound - bound % b and held(gids, covered + b):
                covered += b
            if a < b and b % a == 0:
                for p in range(min(covered + b - a, bound - bound % a), covered, -a):
                    if held(gids, p):
                        covered = p
                        break
            bound = covered - covered % a
        for p in range(bound, -1, -1):
            if p % a:
                continue
            ok = True
            for (kind, b, window), gids in other:
                if p == 0:
                    continue
                if kind in WINDOW_KINDS:
                    need = max(1, -(-(window - 1) // b))
                    ok = p % b == 0 and all(
                        held(gids, q) for q in range(max(0, p - need * b) + b, p + 1, b)
                    )
                else:
                    fine = a < b and b % a == 0
                    ok = (fine or p % b == 0) and held(gids, p)
                if not ok:
                    break
            if ok:
                return p
        return 0
