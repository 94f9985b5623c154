"""The fleet's inverted index: content key -> which workers hold it, per group slot.

One dict per group slot maps a content key to the workers whose group in that slot
holds it, as an integer bitset (bit i = worker index i). A key held by a single worker
(the common case for conversation tails) stores that worker's tag, `~index`, instead:
one shared int object per worker, so a unique block costs no bitset allocation. Copies
beyond the first are counted on the side, per worker.
"""

from __future__ import annotations

from collections.abc import Iterable


def decode(value: int | None) -> int:
    """A stored value as a bitset (0 when absent)."""
    if value is None:
        return 0
    return value if value >= 0 else 1 << ~value


class InvertedIndex:
    """Per-slot dicts shared by all workers, and the workers' tags."""

    __slots__ = ("slots", "tags")

    def __init__(self) -> None:
        self.slots: list[dict[int, int]] = []
        self.tags: list[int] = []

    def ensure_slot(self, slot: int) -> None:
        while len(self.slots) <= slot:
            self.slots.append({})

    def tag(self, index: int) -> int:
        while len(self.tags) <= index:
            self.tags.append(~len(self.tags))
        return self.tags[index]

    def holds(self, index: int, slot: int, key: int) -> bool:
        """Whether worker `index` holds `key` in `slot`."""
        if slot >= len(self.slots):
            return False
        v = self.slots[slot].get(key)
        if v is None:
            return False
        return v == ~index if v < 0 else bool(v >> index & 1)


class WorkerSink:
    """`PresenceSink` of one worker in the fleet's inverted index."""

    __slots__ = ("_bit", "_extra", "_index", "_inv", "_present", "_tag")

    def __init__(self, inv: InvertedIndex, index: int) -> None:
        self._inv = inv
        self._index = index
        self._bit = 1 << index
        self._tag = inv.tag(index)
        self._extra: dict[tuple[int, int], int] = {}  # (slot, key) -> copies, when >= 2
        self._present: list[int] = []  # per slot: keys held

    def add_slot(self, slot: int) -> None:
        self._inv.ensure_slot(slot)
        while len(self._present) <= slot:
            self._present.append(0)

    def add(self, slot: int, key: int) -> None:
        d = self._inv.slots[slot]
        v = d.get(key)
        if v is None:
            d[key] = self._tag
        elif v == self._tag or (v >= 0 and v & self._bit):
            self._extra[slot, key] = self._extra.get((slot, key), 1) + 1
            return
        elif v < 0:
            d[key] = (1 << ~v) | self._bit
        else:
            d[key] = v | self._bit
        self._present[slot] += 1

    def _mine(self, v: int | None) -> bool:
        if v is None:
            return False
        return v == self._tag if v < 0 else bool(v & self._bit)

    def _unset(self, d: dict[int, int], key: int, v: int) -> None:
        if v < 0:
            del d[key]
            return
        v ^= self._bit
        # back to a single holder: store its shared tag
        d[key] = self._inv.tags[v.bit_length() - 1] if v & (v - 1) == 0 else v

    def discard(self, slot: int, key: int) -> bool:
        d = self._inv.slots[slot]
        v = d.get(key)
        if v is None or not self._mine(v):
            return False
        n = self._extra.get((slot, key))
        if n is not None:
            if n == 2:
                del self._extra[slot, key]
            else:
                self._extra[slot, key] = n - 1
            return True
        self._unset(d, key, v)
        self._present[slot] -= 1
        return True

    def holds(self, key: int) -> bool:
        slots = self._inv.slots
        return any(self._mine(slots[s].get(key)) for s in range(len(self._present)))

    def drop(self, key: int) -> None:
        slots = self._inv.slots
        for s in range(len(self._present)):
            d = slots[s]
            v = d.get(key)
            if v is not None and self._mine(v):
                self._extra.pop((s, key), None)
                self._unset(d, key, v)
                self._present[s] -= 1

    def clear(self, keys: Iterable[int]) -> None:
        for key in set(keys):
            self.drop(key)
        self._extra.clear()
        self._present = [0] * len(self._present)

    def present(self, slot: int) -> int:
        return self._present[slot] if slot < len(self._present) else 0


class WorkerPresence:
    """`in` test for one worker's slot, for the per-worker rules."""

    __slots__ = ("_d", "_index", "_tag")

    def __init__(self, inv: InvertedIndex, index: int, slot: int) -> None:
        inv.ensure_slot(slot)
        self._d = inv.slots[slot]
        self._index = index
        self._tag = ~index

    def __contains__(self, key: object) -> bool:
        v = self._d.get(key)  # type: ignore[call-overload]
        if v is None:
            return False
        return bool(v == self._tag if v < 0 else v >> self._index & 1)
