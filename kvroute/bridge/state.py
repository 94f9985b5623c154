"""One engine rank's current KV cache, as learned from its events, and its `Snapshot`.

The state keeps, per group, a copy count for every (group, hash) and, for every live copy,
the STORE it came from (its parent link and token span), so that a snapshot replayed into an
empty view rebuilds both membership and positions:

- records: one per converted STORE, in arrival order. A dense STORE whose parent is the last
  block of an earlier dense record (same group and namespace) is appended to that record, so
  decode-time single-block stores cost no more than prefill ones;
- attribution: per group, hash -> the record (or records, one per copy) holding each copy.
  REMOVE withdraws the newest copy; a record with no live copy is dropped;
- snapshot: group declarations (empty STOREs) first, then every record's live blocks: dense
  records as contiguous runs (a run starting mid-record names the previous block as parent),
  sparse records whole with their live hashes; parents before children.

Lineage of evicted ancestors: a live block's position comes from its record's parent link
and tokens, and the parent's from its own record, up to token 0. Without a full-attention
group (sliding-window-only, Mamba + sliding window) a live block's ancestors are often
evicted. So every record also points (`up`) to the record that placed its parent (sparse
records: the dense record that placed their hashes), found when it arrives, and a record
whose last copy goes stays as lineage only while a kept record points to it (`down`
counts them); it is released, and so in turn are the ancestors only it needed, when the
last one goes. The snapshot sends, in `lineage`, the whole dense records that place the
runs nothing in `events` places (position-only: they add no copies). A parent the state
never saw cached stays unknown (the run waits in a fresh view, as in a live one).

Representation (millions of blocks: about 60-110 bytes each, `bench.bridge_bench`): hashes
are held as keys (kvroute.bridge.copy_table: an 8-byte hash as a 64-bit int), a record's in an
array('Q') (8 bytes a block; a list only for other lengths), its tokens packed 2-4 bytes
each (kvroute.bridge.packed_tokens); records are named by reusable slots, and each group's
attribution is a `CopyTable`, an open-addressing table of key -> slot arrays (12 bytes a
slot) instead of a dict of bytes objects (tests/bridge/test_bridge_state_model.py checks
the state against a small model of these promises).

Tiers (spec §10): a batch's `tier_events` (CPU, STORAGE) go to one more `EngineState` per
lower tier, created on first use, with the same bounds; an INVALID or a contradiction there
discards that tier's view only, a CLEAR in `events` empties every tier. The snapshot carries
each tier's view in `tier_events` / `tier_lineage`, every event marked with its tier, and in
`tier_chunks` the chunk each tier's live stores showed (`kvroute.proto.tier_chunk`: the records
join a chain of chunks into one run, so a subscriber could not tell it from the runs). The
chunk is the engine's setting: it outlives a CLEAR or an INVALID and goes with a reset.

Building a snapshot of a large state takes a while, so `snapshot_steps` builds the same
message, tiers included, in bounded steps and serialized pieces, for a caller that keeps the
state unchanged meanwhile (kvroute.bridge.stream).

Bounds: `max_blocks` live copies (beyond it the oldest records are dropped and counted: a
late subscriber then sees less than the engine holds, never more), `max_lineage_blocks`
blocks kept as lineage only (beyond it the oldest lineage is dropped and counted: runs
below it are then unplaced in a snapshot, a lower answer) and `max_groups` groups.
"""

from __future__ import annotations

from array import array
from collections.abc import Generator, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from kvroute.bridge import packed_tokens
from kvroute.bridge.copy_table import MAX_SLOT, CopyTable, Key, hash_of, hashes_of, key_of, keys_of
from kvroute.bridge.groups import LOWER_TIERS, Groups, with_invalid_before
from kvroute.proto.events_pb2 import KvEventBatch, KvGroupEvent, Snapshot, SubscribeResponse, Tier
from kvroute.proto.tier_chunk import store_chunk

if TYPE_CHECKING:
    from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

STORE: Final = KvGroupEvent.STORE
REMOVE: Final = KvGroupEvent.REMOVE
CLEAR: Final = KvGroupEvent.CLEAR
INVALID: Final = KvGroupEvent.INVALID

DEFAULT_MAX_BLOCKS: Final = 2_000_000
DEFAULT_MAX_LINEAGE_BLOCKS: Final = 2_000_000
DEFAULT_MAX_GROUPS: Final = 64
# Blocks of work per step of a snapshot build (about a millisecond), and per serialized piece.
DEFAULT_STEP_BLOCKS: Final = 512
_MAX_INTERNED_META: Final = 4096


class _Meta:
    """What a record's blocks share (interned: many records point to one)."""

    __slots__ = ("block_size", "group", "kind", "lora", "unmatchable", "window")

    def __init__(
        self, group: int, block_size: int, kind: str, window: int, lora: str, unmatchable: bool
    ) -> None:
        self.group = group
        self.block_size = block_size
        self.kind = kind
        self.window = window
        self.lora = lora
        self.unmatchable = unmatchable


_Keys: TypeAlias = (
    "array[int] | list[Key]"  # a record's block keys (kvroute.bridge.copy_table), in order
)


class _Record:
    """One STORE (or a dense chain of them): its blocks, parent and token span."""

    __slots__ = (
        "dense",
        "down",
        "hashes",
        "live",
        "meta",
        "parent",
        "salt",
        "slot",
        "span",
        "tokens",
        "up",
        "width",
    )

    def __init__(
        self,
        meta: _Meta,
        salt: str,
        parent: bytes,
        hashes: _Keys,
        tokens: bytes | bytearray,
        width: int,
        dense: bool,
    ) -> None:
        self.meta = meta
        self.salt = salt
        self.parent = parent
        self.hashes = hashes  # block keys: an array('Q') when all hashes have 8 bytes
        self.tokens = tokens  # packed (kvroute.bridge.packed_tokens), possibly shared
        self.width = width
        # Token range [start, stop) of `tokens` that is this record's span; None = all of it
        # (dense records own and extend their buffer; sparse ones may borrow a dense one's).
        self.span: tuple[int, int] | None = None
        self.dense = dense
        self.live = 0
        self.slot = 0  # its name in the copy tables and `_records`; -1 once released
        # The record that places this one's parent (sparse: its hashes), and how many kept
        # records point here: a record without live copies is kept while down > 0.
        self.up: _Record | None = None
        self.down = 0


# (record, first block, stop block, live keys): one run of a snapshot.
_Run: TypeAlias = "tuple[_Record, int, int, _Keys]"


class StateStats:
    """Counters (read by metrics)."""

    __slots__ = ("evicted_blocks", "evicted_lineage_blocks", "invalid_resets", "unknown_removes")

    def __init__(self) -> None:
        self.evicted_blocks = 0  # live copies dropped at the max_blocks bound
        self.evicted_lineage_blocks = 0  # lineage-only blocks dropped at max_lineage_blocks
        self.unknown_removes = 0  # REMOVEs of a (group, hash) the state did not hold
        self.invalid_resets = 0  # INVALID events applied (the view was discarded)


class _BatchScratch:
    """Per-batch sharing: the groups of one step report the same spans and hashes."""

    __slots__ = ("parents", "spans")

    def __init__(self) -> None:
        self.parents: dict[bytes, bytes] = {}
        # packed span (and width) of a dense store -> (its record, first token)
        self.spans: dict[tuple[bytes, int], tuple[_Record, int]] = {}


class EngineState:
    """The current cache of one engine rank; see the module docstring."""

    def __init__(
        self,
        dp_rank: int = 0,
        *,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        max_groups: int = DEFAULT_MAX_GROUPS,
        max_lineage_blocks: int = DEFAULT_MAX_LINEAGE_BLOCKS,
    ) -> None:
        if max_blocks < 1 or max_groups < 1 or max_lineage_blocks < 1:
            raise ValueError("max_blocks, max_groups and max_lineage_blocks must be positive")
        self.dp_rank = dp_rank
        self.max_blocks = max_blocks
        self.max_groups = max_groups
        self.max_lineage_blocks = max_lineage_blocks
        self.stats = StateStats()
        self.last_sequence: int | None = None
        self._groups = Groups(max_groups)
        self._meta: dict[tuple[int, int, str, int, str, bool], _Meta] = {}
        # slot -> record with live copies, in arrival order (a dict keeps it, deletes O(1);
        # a record appended to moves to the end)
        self._records: dict[int, _Record] = {}
        self._next_slot = 0
        self._free_slots: list[int] = []  # slots of released records, for reuse
        # group -> key -> the slots of the records holding its copies (one per copy)
        self._copies: dict[int, CopyTable] = {}
        # group -> last key of a dense record -> that record (for appending chains)
        self._tails: dict[int, dict[Key, _Record]] = {}
        # slot -> record without live copies kept for a kept record's lineage, oldest first.
        self._lineage: dict[int, _Record] = {}
        self.blocks = 0  # live copies
        self.lineage_blocks = 0  # blocks of the records in _lineage
        self._tiers: dict[Tier.ValueType, EngineState] = {}  # lower tier -> its view
        self.chunk = 0  # a lower tier's view: tokens per offloaded chunk (0: none seen)

    # -- queries --------------------------------------------------------------------------

    @property
    def groups(self) -> dict[int, tuple[str, int, int]]:
        """group -> (kind, sliding window, largest block size seen)."""
        return {gid: (g.kind, g.window, g.block_size) for gid, g in self._groups.table.items()}

    def copies(self, group: int, block_hash: bytes) -> int:
        """How many copies of (group, hash) the engine holds."""
        table = self._copies.get(group)
        return 0 if table is None else table.count(key_of(block_hash))

    @property
    def records(self) -> int:
        return len(self._records)

    def tier(self, tier: Tier.ValueType) -> EngineState | None:
        """A lower tier's view (None until the engine reported that tier)."""
        return self._tiers.get(tier)

    @property
    def tiers(self) -> dict[Tier.ValueType, EngineState]:
        """Lower tier -> its view, for the tiers the engine reported."""
        return dict(self._tiers)

    def _tier_state(self, tier: Tier.ValueType) -> EngineState:
        state = self._tiers.get(tier)
        if state is None:
            state = EngineState(
                self.dp_rank,
                max_blocks=self.max_blocks,
                max_groups=self.max_groups,
                max_lineage_blocks=self.max_lineage_blocks,
            )
            self._tiers[tier] = state
        return state

    # -- updates --------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget everything, groups and sequence included, in every tier."""
        self.last_sequence = None
        self._groups.clear()
        self._clear_blocks()
        self._tiers.clear()

    def _clear_blocks(self) -> None:
        self._records.clear()
        self._next_slot = 0
        self._free_slots.clear()
        self._copies.clear()
        self._tails.clear()
        self._meta.clear()
        self._lineage.clear()
        self.blocks = 0
        self.lineage_blocks = 0

    def apply(self, batch: KvEventBatch) -> KvEventBatch:
        """Apply a converted batch; returns the batch subscribers must receive.

        That is `batch` itself, unless an event contradicts what the state knows (a group
        changing kind or window, or a group beyond `max_groups`): then a copy in which an
        INVALID event (view discarded) precedes the contradicting event, for the state and
        every subscriber alike.
        """
        amended = self._apply_events(batch.events)
        if any(event.operation == CLEAR for event in batch.events):
            for state in self._tiers.values():
                state._clear_blocks()
        tier_amended: set[int] = set()
        if batch.tier_events:
            for tier in LOWER_TIERS:
                # A tier this bridge does not know never reaches its own output.
                at = [i for i, event in enumerate(batch.tier_events) if event.tier == tier]
                if at:
                    state = self._tier_state(tier)
                    for i in at:
                        state.chunk = max(state.chunk, store_chunk(batch.tier_events[i]))
                    local = state._apply_events(batch.tier_events[i] for i in at)
                    tier_amended.update(at[i] for i in local)
        self.last_sequence = batch.sequence
        if not amended and not tier_amended:
            return batch
        return with_invalid_before(batch, amended, tier_amended)

    def _apply_events(self, events: Iterable[KvGroupEvent]) -> set[int]:
        """Apply events in order; the positions that needed an INVALID before them."""
        amended: set[int] = set()
        scratch = _BatchScratch()
        for index, event in enumerate(events):
            op = event.operation
            if op == STORE:
                if not self._declare(event):
                    amended.add(index)
                    self._apply_invalid()
                    self._declare(event)
                self._store(event, scratch)
            elif op == REMOVE:
                self._remove(event.group_id, event.block_hashes)
            elif op == CLEAR:
                self._clear_blocks()
            else:
                self._apply_invalid()
        return amended

    def _apply_invalid(self) -> None:
        self.stats.invalid_resets += 1
        self._groups.clear()
        self._clear_blocks()

    def _declare(self, event: KvGroupEvent) -> bool:
        """Learn the group's metadata; False if it contradicts what is known."""
        return self._groups.declare(event)

    def _meta_for(self, event: KvGroupEvent) -> _Meta:
        key = (
            event.group_id,
            event.block_size,
            event.kind,
            event.sliding_window,
            event.lora_name,
            event.unmatchable,
        )
        meta = self._meta.get(key)
        if meta is None:
            meta = _Meta(*key)
            if len(self._meta) < _MAX_INTERNED_META:
                self._meta[key] = meta
        return meta

    def _store(self, event: KvGroupEvent, scratch: _BatchScratch) -> None:
        hashes = keys_of(event.block_hashes)
        if not hashes:
            return
        group = event.group_id
        meta = self._meta_for(event)
        block_size = event.block_size
        dense = len(event.token_ids) == len(hashes) * block_size
        parent = event.parent_block_hash
        if parent:
            parent = scratch.parents.setdefault(parent, parent)
        parent_key = key_of(parent) if dense and parent else None
        tails = self._tails.setdefault(group, {})
        record = (
            tails.get(parent_key) if parent_key is not None and not event.cache_namespace else None
        )
        if not dense:
            record = self._new_sparse(event, meta, parent, hashes, scratch)
        elif record is not None and record.meta is meta:
            assert parent_key is not None
            del tails[parent_key]
            if isinstance(record.hashes, array) and isinstance(hashes, array):
                record.hashes.extend(hashes)
            else:
                record.hashes = [*record.hashes, *hashes]
            assert isinstance(record.tokens, bytearray)
            first = packed_tokens.count(record.tokens, record.width)
            record.tokens, record.width = packed_tokens.append(
                record.tokens, record.width, event.token_ids
            )
            self._touch(record)
            self._offer_span(scratch, record, first)
        else:
            tokens, width = packed_tokens.pack(event.token_ids)
            record = self._add_record(
                _Record(meta, event.cache_namespace, parent, hashes, tokens, width, True)
            )
            if parent_key is not None:
                self._pin(record, self._placer(parent_key, group))
            self._offer_span(scratch, record, 0)
        if dense:
            tails[hashes[-1]] = record
        copies = self._copies.get(group)
        if copies is None:
            copies = self._copies[group] = CopyTable()
        copies.add(hashes, record.slot)
        record.live += len(hashes)
        self.blocks += len(hashes)
        if self.blocks > self.max_blocks:
            self._evict_oldest()

    def _add_record(self, record: _Record) -> _Record:
        if self._free_slots:
            record.slot = self._free_slots.pop()
        else:
            if self._next_slot > MAX_SLOT:  # more records than a copy table can name
                raise OverflowError("too many records")
            record.slot = self._next_slot
            self._next_slot += 1
        self._records[record.slot] = record
        return record

    @staticmethod
    def _offer_span(scratch: _BatchScratch, record: _Record, first: int) -> None:
        tokens = record.tokens
        assert isinstance(tokens, bytearray)
        key = (bytes(tokens[first * record.width :]), record.width)
        scratch.spans.setdefault(key, (record, first))

    def _placer(self, block_key: Key, group: int) -> _Record | None:
        """The record that places `block_key`: a dense record holding it (its own group's
        first), else a sparse holder (placed through its own `up`), else None."""
        sparse: _Record | None = None
        for gid in (group, *(g for g in self._copies if g != group)):
            tail = self._tails.get(gid, {}).get(block_key)
            if tail is not None:
                return tail
            table = self._copies.get(gid)
            if table is None:
                continue
            for slot in table.holders(block_key):
                record = self._records[slot]
                if record.dense:
                    return record
                sparse = sparse or record
        return sparse

    @staticmethod
    def _pin(record: _Record, up: _Record | None) -> None:
        if up is not None:
            record.up = up
            up.down += 1

    def _new_sparse(
        self,
        event: KvGroupEvent,
        meta: _Meta,
        parent: bytes,
        hashes: _Keys,
        scratch: _BatchScratch,
    ) -> _Record:
        tokens, width = packed_tokens.pack(event.token_ids)
        # Sparse groups of one step usually repeat a dense group's span: borrow it.
        found = scratch.spans.get((bytes(tokens), width))
        record = _Record(meta, event.cache_namespace, parent, hashes, tokens, width, False)
        if found is not None:
            dense, first = found
            record.tokens = dense.tokens
            record.span = (first, first + packed_tokens.count(tokens, width))
        # Its hashes are placed by the dense record that holds them (the span's, usually).
        self._pin(record, self._placer(hashes[-1], event.group_id))
        return self._add_record(record)

    def _touch(self, record: _Record) -> None:
        del self._records[record.slot]
        self._records[record.slot] = record  # now the newest

    def _remove(self, group: int, hashes: Iterable[bytes]) -> None:
        copies = self._copies.get(group)
        for block_hash in hashes:
            slot = None if copies is None else copies.pop(key_of(block_hash))
            if slot is None:
                self.stats.unknown_removes += 1
                continue
            record = self._records[slot]
            self.blocks -= 1
            record.live -= 1
            if record.live == 0:
                self._drop(record)

    def _drop(self, record: _Record) -> None:
        """The record's last live copy went: keep it as lineage if a kept record needs it."""
        del self._records[record.slot]
        tails = self._tails.get(record.meta.group)
        if tails is not None and record.dense and tails.get(record.hashes[-1]) is record:
            del tails[record.hashes[-1]]
        if record.down > 0:
            self._lineage[record.slot] = record
            self.lineage_blocks += len(record.hashes)
            if self.lineage_blocks > self.max_lineage_blocks:
                self._evict_lineage()
        else:
            self._release(record)

    def _release(self, record: _Record) -> None:
        """Forget a record; the lineage records it alone kept go too (iteratively)."""
        current: _Record | None = record
        while current is not None:
            self._free_slots.append(current.slot)
            current.slot = -1
            up, current.up = current.up, None
            current = None
            if up is None:
                continue
            up.down -= 1
            if up.down == 0 and self._lineage.get(up.slot) is up:
                del self._lineage[up.slot]
                self.lineage_blocks -= len(up.hashes)
                current = up

    def _evict_lineage(self) -> None:
        """Drop the oldest lineage down to 7/8 of the bound (what it placed is then unplaced
        in a snapshot: lower answers, never higher)."""
        keep = self.max_lineage_blocks - self.max_lineage_blocks // 8
        while self.lineage_blocks > keep and self._lineage:
            record = next(iter(self._lineage.values()))
            del self._lineage[record.slot]
            self.lineage_blocks -= len(record.hashes)
            self.stats.evicted_lineage_blocks += len(record.hashes)
            # Records below keep pointing here: free the content, mark it dropped.
            record.hashes = array("Q")
            record.tokens = b""
            self._release(record)

    def _evict_oldest(self) -> None:
        while self.blocks > self.max_blocks and self._records:
            record = next(iter(self._records.values()))
            copies = self._copies[record.meta.group]
            for block_key in record.hashes:
                if not copies.discard(block_key, record.slot):
                    continue
                self.blocks -= 1
                self.stats.evicted_blocks += 1
                record.live -= 1
            record.live = 0
            self._drop(record)

    # -- snapshot -------------------------------------------------------------------------

    def snapshot(self, *, stream_id: str = "", reason: str = "") -> Snapshot:
        """The whole current cache as a `Snapshot` (see the module docstring)."""
        sink = _Sink(None)
        for _ in self._build(sink, _Budget(None)):
            pass
        sink.snap.stream_id = stream_id
        sink.snap.reason = reason
        return sink.snap

    def snapshot_steps(
        self,
        out: SnapshotPieces,
        *,
        stream_id: str = "",
        step_blocks: int = DEFAULT_STEP_BLOCKS,
    ) -> Iterator[None]:
        """Build what `snapshot` returns, serialized in pieces appended to `out`, yielding
        after every `step_blocks` blocks of work or so (a single STORE is never split).

        The state must not change until the iterator is exhausted (the caller freezes it).
        """
        sink = _Sink(out.pieces, step_blocks)
        sink.snap.stream_id = stream_id
        yield from self._build(sink, _Budget(step_blocks))
        out.events = sink.events

    def _build(self, sink: _Sink, budget: _Budget) -> Iterator[None]:
        snap = sink.snap
        snap.dp_rank = self.dp_rank
        if self.last_sequence is not None:
            snap.sequence = self.last_sequence
            snap.has_sequence = True
        for tier, state in sorted(self._tiers.items()):
            if state.chunk:  # in the first piece, which is always sent
                snap.tier_chunks.add(tier=tier, tokens=state.chunk)
        yield from self._build_view(sink, budget, Tier.GPU)
        for tier in sorted(self._tiers):
            yield from self._tiers[tier]._build_view(sink, budget, tier)
        sink.finish()

    def _build_view(self, sink: _Sink, budget: _Budget, tier: Tier.ValueType) -> Iterator[None]:
        """Add this view's events and lineage to `sink`, each event marked with `tier` (GPU:
        `events` and `lineage`; a lower tier: `tier_events` and `tier_lineage`)."""
        groups = self._groups.table
        for gid in sorted(groups):
            group = groups[gid]
            sink.events_of(tier).add(
                operation=STORE,
                group_id=gid,
                kind=group.kind,
                sliding_window=group.window,
                block_size=group.block_size,
                tier=tier,
            )
            sink.added(0)
        runs = yield from self._live_runs(budget)
        defines = yield from _defines(runs, budget)
        ordered = yield from _parents_first(runs, defines, budget)
        lineage = yield from _lineage_for(ordered, defines, budget)
        for record in lineage:
            meta = record.meta
            sink.lineage_of(tier).add(
                operation=STORE,
                group_id=meta.group,
                block_hashes=hashes_of(record.hashes),
                parent_block_hash=record.parent,
                token_ids=packed_tokens.unpack(
                    record.tokens, record.width, 0, len(record.hashes) * meta.block_size
                ),
                block_size=meta.block_size,
                kind=meta.kind,
                sliding_window=meta.window,
                lora_name=meta.lora,
                cache_namespace=record.salt,
                unmatchable=meta.unmatchable,
                tier=tier,
            )
            sink.added(len(record.hashes))
            if budget.spend(len(record.hashes)):
                yield
        for run in ordered:
            record, start, stop, hashes = run
            meta = record.meta
            if record.dense:
                bs = meta.block_size
                tokens: Any = packed_tokens.unpack(
                    record.tokens, record.width, start * bs, stop * bs
                )
                parent = record.parent if start == 0 else hash_of(record.hashes[start - 1])
                salt = record.salt if start == 0 else ""
            else:
                start_token, stop_token = record.span or (0, None)
                tokens = packed_tokens.unpack(record.tokens, record.width, start_token, stop_token)
                parent, salt = record.parent, record.salt
                if len(tokens) == len(hashes) * meta.block_size:
                    tokens = ()  # never let a trimmed sparse record look dense
            sink.events_of(tier).add(
                operation=STORE,
                group_id=meta.group,
                block_hashes=hashes_of(hashes),
                parent_block_hash=parent,
                token_ids=tokens,
                block_size=meta.block_size,
                kind=meta.kind,
                sliding_window=meta.window,
                lora_name=meta.lora,
                cache_namespace=salt,
                unmatchable=meta.unmatchable,
                tier=tier,
            )
            sink.added(len(hashes))
            if budget.spend(len(hashes)):
                yield

    def _live_runs(self, budget: _Budget) -> Generator[None, None, list[_Run]]:
        """(record, start, stop, live hashes) in arrival order; dense records as runs."""
        runs: list[_Run] = []
        for record in self._records.values():
            if budget.spend(1):
                yield
            copies = self._copies[record.meta.group]
            if record.live == len(record.hashes) and not _has_repeats(record):
                runs.append((record, 0, len(record.hashes), record.hashes))
                continue
            if budget.spend(len(record.hashes)):
                yield
            owned: dict[Key, int] = {}
            mask: list[bool] = []
            for block_key in record.hashes:
                if block_key not in owned:
                    owned[block_key] = copies.holders(block_key).count(record.slot)
                left = owned[block_key]
                mask.append(left > 0)
                if left:
                    owned[block_key] = left - 1
            if not record.dense:
                live: _Keys = [h for h, keep in zip(record.hashes, mask, strict=True) if keep]
                if live:
                    runs.append((record, 0, len(record.hashes), live))
                continue
            start = None
            for index, keep in enumerate([*mask, False]):
                if keep and start is None:
                    start = index
                elif not keep and start is not None:
                    runs.append((record, start, index, record.hashes[start:index]))
                    start = None
        return runs


class SnapshotPieces:
    """A snapshot serialized in pieces: each a `SubscribeResponse` holding part of it, which
    concatenated parse as one message (repeated fields append); its reason is left unset."""

    __slots__ = ("events", "pieces")

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.events = 0  # events and lineage events in all pieces


class _Budget:
    """Work left in the current step of a snapshot build (size None: a single step)."""

    __slots__ = ("left", "size")

    def __init__(self, size: int | None) -> None:
        self.size = size
        self.left = size or 0

    def spend(self, work: int) -> bool:
        """Count `work`; True when the step is used up (the builder then yields)."""
        if self.size is None:
            return False
        self.left -= work
        if self.left > 0:
            return False
        self.left = self.size
        return True


class _Sink:
    """Where a snapshot's events go: one `Snapshot` (pieces None), or serialized pieces of
    about `piece_blocks` blocks each, so that no single serialization is large."""

    __slots__ = ("blocks", "events", "message", "piece_blocks", "pieces", "snap", "unsent")

    def __init__(self, pieces: list[bytes] | None, piece_blocks: int = 0) -> None:
        self.pieces = pieces
        self.piece_blocks = piece_blocks
        self.events = 0
        self.blocks = 0  # in the current piece
        self.unsent = 0  # events in the current piece (group declarations hold no block)
        self.message = SubscribeResponse()
        self.snap = Snapshot()
        if pieces is not None:
            self.snap = self.message.snapshot
            self.snap.SetInParent()  # the first piece says "snapshot" even when empty

    def events_of(self, tier: Tier.ValueType) -> RepeatedCompositeFieldContainer[KvGroupEvent]:
        """Where a view's events go in the current piece (the GPU's apart from the rest)."""
        return self.snap.events if tier == Tier.GPU else self.snap.tier_events

    def lineage_of(self, tier: Tier.ValueType) -> RepeatedCompositeFieldContainer[KvGroupEvent]:
        """Where a view's lineage goes in the current piece."""
        return self.snap.lineage if tier == Tier.GPU else self.snap.tier_lineage

    def added(self, blocks: int) -> None:
        """One event was added to `snap`, holding `blocks` blocks."""
        self.events += 1
        self.unsent += 1
        self.blocks += blocks
        if self.pieces is not None and self.blocks >= self.piece_blocks:
            self._flush()

    def finish(self) -> None:
        if self.pieces is not None and (self.unsent or not self.pieces):
            self._flush()

    def _flush(self) -> None:
        assert self.pieces is not None
        self.pieces.append(self.message.SerializeToString())
        self.message = SubscribeResponse()
        self.snap = self.message.snapshot
        self.blocks = 0
        self.unsent = 0


def _has_repeats(record: _Record) -> bool:
    # Repeated hashes inside one record only come from unusual producers.
    return len(record.hashes) > 1 and len(set(record.hashes)) != len(record.hashes)


def _run_parent(record: _Record, start: int) -> Key | None:
    """The key of the parent of a run starting at block `start` of `record` (None: none)."""
    if start:
        return record.hashes[start - 1]
    return key_of(record.parent) if record.parent else None


def _defines(runs: list[_Run], budget: _Budget) -> Generator[None, None, dict[Key, int]]:
    """Block key -> the first dense run (index in `runs`) that places it."""
    defines: dict[Key, int] = {}
    for position, (record, _, _, hashes) in enumerate(runs):
        if record.dense:
            for block_hash in hashes:
                defines.setdefault(block_hash, position)
        if budget.spend(1 + len(hashes)):
            yield
    return defines


def _lineage_for(
    runs: list[_Run], defines: dict[Key, int], budget: _Budget
) -> Generator[None, None, list[_Record]]:
    """The dense records, parents first, that place the runs no dense run places: a dense
    run whose parent none places (mid-record: its own record; else the parent's placer),
    a sparse run with a hash none places (its hashes' placer), and their ancestors up to
    token 0 or to lineage the state no longer has."""
    out: list[_Record] = []
    seen: set[int] = set()
    for record, start, _, hashes in runs:
        if budget.spend(1):
            yield
        if record.dense:
            parent = _run_parent(record, start)
            if parent is None or parent in defines:
                continue
            need = record if start else record.up
        elif all(block_hash in defines for block_hash in hashes):
            continue
        else:
            need = record.up
        # Each lineage chain is whole down from token 0 (or from lineage sent already), so
        # a subscriber places it before it reads `events`.
        chain: list[_Record] = []
        while need is not None and need.slot >= 0 and id(need) not in seen:
            seen.add(id(need))
            if need.dense and need.hashes:
                chain.append(need)
                if not need.parent:
                    break
            need = need.up
        out.extend(reversed(chain))
    return out


def _parents_first(
    runs: list[_Run], defines: dict[Key, int], budget: _Budget
) -> Generator[None, None, list[_Run]]:
    """Reorder runs so that a dense run defining a block's position precedes its children."""
    ordered: list[_Run] = []
    done = [False] * len(runs)
    for first in range(len(runs)):
        if budget.spend(1):
            yield
        chain = []
        index: int | None = first
        # Walk up to the first ancestor run already emitted (or the root), then emit down.
        while index is not None and not done[index]:
            done[index] = True
            chain.append(index)
            record, start, _, _ = runs[index]
            parent = _run_parent(record, start)
            index = None if parent is None else defines.get(parent)
        ordered.extend(runs[i] for i in reversed(chain))
    return ordered
