"""A brute-force predictor of vLLM's prefix hit from converted events, for triage only.

It is not kvroute's indexer and is not used by the product. The conformance tests run it next
to `indexer.GroupCache` on the same events: when it agrees with vLLM and the indexer does not,
the indexer is wrong; when it disagrees too, the events do not carry what vLLM knows (or the
bridge lost it). It keeps everything forever and evaluates docs/reference/vllm-kv-events.md §7
literally, one candidate position at a time.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvroute.proto.events_pb2 import KvEventBatch, KvGroupEvent

UNIT = 16  # positions are tracked at this granularity; it divides every block size used here


def content_keys(tokens: Sequence[int], namespace: tuple[str, str], end: int) -> list[int]:
    """keys[i] identifies (namespace, tokens[: (i + 1) * UNIT]) for every full unit < end."""
    keys = []
    key = hash(namespace)
    for start in range(0, end - UNIT + 1, UNIT):
        key = hash((key, tuple(tokens[start : start + UNIT])))
        keys.append(key)
    return keys


@dataclass
class _Group:
    kind: str
    window: int
    block_size: int = 0


@dataclass
class _Position:
    end: int
    key: int
    namespace: tuple[str, str]


@dataclass
class EventOracle:
    groups: dict[int, _Group] = field(default_factory=dict)
    sizes: set[int] = field(default_factory=set)
    copies: Counter[tuple[int, bytes]] = field(default_factory=Counter)
    positions: dict[bytes, _Position] = field(default_factory=dict)
    by_key: dict[int, set[bytes]] = field(default_factory=dict)
    pending: list[KvGroupEvent] = field(default_factory=list)
    # The worker's hit alignment when configured (not always inferable, see docs/indexer.md).
    alignment_override: int | None = None

    # ---- events ---------------------------------------------------------------------------

    def apply(self, batch: KvEventBatch) -> None:
        for event in batch.events:
            if event.operation == KvGroupEvent.STORE:
                self._store(event)
            elif event.operation == KvGroupEvent.REMOVE:
                for h in event.block_hashes:
                    if self.copies[(event.group_id, h)] > 0:
                        self.copies[(event.group_id, h)] -= 1
            elif event.operation == KvGroupEvent.CLEAR:
                self.copies.clear()
            else:
                raise AssertionError(f"unexpected event {event}")
        self._resolve_pending()

    def _store(self, event: KvGroupEvent) -> None:
        group = self.groups.setdefault(
            event.group_id, _Group(event.kind, event.sliding_window, event.block_size)
        )
        group.block_size = max(group.block_size, event.block_size)
        self.sizes.add(event.block_size)
        for h in event.block_hashes:
            self.copies[(event.group_id, h)] += 1
        if len(event.token_ids) == len(event.block_hashes) * event.block_size:
            self.pending.append(event)

    def _resolve_pending(self) -> None:
        progress = True
        while progress and self.pending:
            progress = False
            for event in list(self.pending):
                if self._learn(event):
                    self.pending.remove(event)
                    progress = True

    def _learn(self, event: KvGroupEvent) -> bool:
        """Positions and content of a dense store's hashes, once its parent is known."""
        if event.parent_block_hash:
            parent = self.positions.get(event.parent_block_hash)
            if parent is None:
                return False
            start, key, namespace = parent.end, parent.key, parent.namespace
        else:
            start, namespace = 0, (event.lora_name, event.cache_namespace)
            key = hash(namespace)
        if event.unmatchable:
            return True
        tokens = list(event.token_ids)
        size = event.block_size
        for i, h in enumerate(event.block_hashes):
            for u in range(i * size, (i + 1) * size, UNIT):
                key = hash((key, tuple(tokens[u : u + UNIT])))
            end = start + (i + 1) * size
            known = self.positions.get(h)
            if known is not None and (known.end, known.key) != (end, key):
                raise AssertionError(f"hash {h.hex()} learned at two positions")
            self.positions[h] = _Position(end, key, namespace)
            self.by_key.setdefault(key, set()).add(h)
        return True

    # ---- the answer -------------------------------------------------------------------------

    def alignment(self) -> int:
        if self.alignment_override is not None:
            return self.alignment_override
        sizes = [g.block_size for g in self.groups.values()]
        unit = math.gcd(*self.sizes)
        partial = any(g.kind == "mamba" and g.block_size > unit for g in self.groups.values())
        partial = partial and all(
            g.kind in ("full_attention", "mamba") or g.block_size == unit
            for g in self.groups.values()
        )
        return unit if partial else math.lcm(*sizes)

    def _held(self, group_id: int, key: int | None) -> bool:
        if key is None:
            return False
        return any(self.copies[(group_id, h)] > 0 for h in self.by_key.get(key, ()))

    def per_group(
        self, tokens: Sequence[int], namespace: tuple[str, str] = ("", "")
    ) -> tuple[int, dict[int, int]]:
        """(joint hit, each group's own longest hit), or (0, {}) with no groups."""
        if not self.groups:
            return 0, {}
        cap = len(tokens) - 1
        align = self.alignment()
        keys = content_keys(tokens, namespace, cap)

        def key_at(p: int) -> int | None:
            return keys[p // UNIT - 1] if p % UNIT == 0 and 0 < p <= len(keys) * UNIT else None

        accept: dict[int, set[int]] = {}
        for gid, g in self.groups.items():
            accept[gid] = self._accepted(gid, g, key_at, cap, align)
        aligned = list(range(cap - cap % align, -1, -align))
        own = {gid: next(p for p in aligned if p in acc) for gid, acc in accept.items()}
        joint = next(p for p in aligned if all(p in acc for acc in accept.values()))
        return joint, own

    def _accepted(
        self, gid: int, g: _Group, at: Callable[[int], int | None], cap: int, align: int
    ) -> set[int]:
        """The positions <= cap (multiples of UNIT) this group accepts (§7.5)."""
        held = self._held
        b = g.block_size
        positions = range(0, cap + 1, UNIT)
        if g.kind in ("full_attention", "mla_attention", "sink_full_attention"):
            cover = 0
            while cover + b <= cap and held(gid, at(cover + b)):
                cover += b
            if align < b:  # fine-grained: a partial entry inside the first missing block
                for q in range(min(cover + b - UNIT, cap - cap % UNIT), cover, -UNIT):
                    if held(gid, at(q)):
                        cover = q
                        break
            return {p for p in positions if p <= cover}
        if g.kind in ("sliding_window", "sliding_window_mla"):
            need = -(-(g.window - 1) // b)
            return {
                p
                for p in positions
                if p % b == 0
                and all(held(gid, at(e)) for e in range(max(0, p - need * b) + b, p + 1, b))
            }
        if g.kind == "mamba":
            step = UNIT if align < b else b
            return {0} | {p for p in positions if p % step == 0 and held(gid, at(p))}
        raise AssertionError(f"the oracle does not model {g.kind!r}")
