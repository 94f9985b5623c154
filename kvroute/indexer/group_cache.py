"""`GroupCache`: one worker's view and vLLM's hit rules, usable on its own."""

from __future__ import annotations

from collections.abc import Container, Sequence

from kvroute.indexer.feed import Feed
from kvroute.indexer.keys import Namespace, content_keys
from kvroute.indexer.layout import Layout, Unit, check_alignment
from kvroute.indexer.lineage import Lineage
from kvroute.indexer.presence import AllOf, DictSink
from kvroute.indexer.results import GroupScore, WorkerScore, WorkerStats
from kvroute.indexer.rules import longest_hit, unit_longest
from kvroute.proto import events_pb2


def group_scores(layout: Layout, per_slot: dict[int, int]) -> list[GroupScore]:
    """Per-group breakdown: each group gets its unit's own longest hit (None if unusable)."""
    return [
        GroupScore(g.group_id, g.kind, g.block_size, g.sliding_window, per_slot.get(g.slot))
        for g in sorted(layout.groups, key=lambda g: g.group_id)
    ]


def explain_layout(
    layout: Layout,
    presence_of: dict[int, Container[int]],
    keys: Sequence[int],
    n_tokens: int,
    hash_unit: int,
) -> WorkerScore:
    """Score one worker from its layout and per-slot presence (vLLM's coordinator)."""
    if not layout.usable:
        return WorkerScore(None, group_scores(layout, {}), 0, layout.reason)
    cap = max(n_tokens - 1, 0)

    def presence(unit: Unit) -> Container[int]:
        if len(unit.slots) == 1:
            return presence_of[unit.slots[0]]
        return AllOf([presence_of[s] for s in unit.slots])

    per_slot: dict[int, int] = {}
    for unit in layout.units:
        hit = unit_longest(unit, presence(unit), keys, cap, layout.alignment, hash_unit)
        for slot in unit.slots:
            per_slot[slot] = hit
    total = longest_hit(layout, presence, keys, cap, hash_unit)
    return WorkerScore(total, group_scores(layout, per_slot), layout.alignment, "")


class GroupCache:
    """One worker: apply its batches, then ask how many tokens of a request vLLM reuses.

    `reusable_tokens` is None when there is no usable evidence (no groups reported, or a
    group kind that cannot be modelled), which is different from 0.
    """

    def __init__(
        self,
        hash_unit: int = 16,
        *,
        max_entries: int = 2_000_000,
        max_pending: int = 100_000,
    ) -> None:
        if hash_unit <= 0:
            raise ValueError("hash_unit must be positive")
        self.hash_unit = hash_unit
        self._sink = DictSink()
        self._lineage = Lineage(self._sink, hash_unit, max_entries, max_pending)
        self._feed = Feed(self._lineage)

    def apply(self, batch: events_pb2.KvEventBatch) -> None:
        """Apply a batch in sequence order (stale ignored, a gap discards the view first)."""
        self._feed.apply(batch)

    def apply_snapshot(self, snapshot: events_pb2.Snapshot) -> None:
        """Replace the view with a snapshot's contents."""
        self._feed.apply_snapshot(snapshot)

    def invalidate(self) -> None:
        """The stream was lost: no score until new evidence."""
        self._feed.invalidate()

    def set_alignment(self, alignment: int | None) -> None:
        """Override the inferred alignment (None: infer it again)."""
        check_alignment(alignment, self.hash_unit)
        self._lineage.set_alignment(alignment)

    def layout(self) -> Layout:
        """The worker's cache layout as learned from its events."""
        return self._lineage.layout()

    def reusable_tokens(
        self, token_ids: Sequence[int], namespace: Namespace | None = None
    ) -> int | None:
        """Tokens of this request vLLM would reuse on this worker, or None."""
        return self.explain(token_ids, namespace).reusable_tokens

    def reusable_tokens_for_keys(self, keys: Sequence[int], n_tokens: int) -> int | None:
        """Like `reusable_tokens`, from `content_keys` computed by the caller."""
        return self.explain_keys(keys, n_tokens).reusable_tokens

    def explain(self, token_ids: Sequence[int], namespace: Namespace | None = None) -> WorkerScore:
        """The score with its per-group breakdown."""
        keys = content_keys(token_ids, namespace, self.hash_unit)
        return self.explain_keys(keys, len(token_ids))

    def explain_keys(self, keys: Sequence[int], n_tokens: int) -> WorkerScore:
        """`explain` from `content_keys` the caller already computed."""
        layout = self._lineage.layout()
        presence_of: dict[int, Container[int]] = dict(enumerate(self._sink.slots))
        return explain_layout(layout, presence_of, keys, n_tokens, self.hash_unit)

    def presence_by_group(self) -> dict[int, Container[int]]:
        """Group id -> the content keys the group holds (live, positioned blocks)."""
        slots = self._sink.slots
        return {g.group_id: slots[g.slot] for g in self.layout().groups if g.slot < len(slots)}

    def stats(self) -> WorkerStats:
        """The view's counters and sizes."""
        return self._feed.stats()
