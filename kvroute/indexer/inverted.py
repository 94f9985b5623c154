"""The fleet's inverted index: content key -> which workers hold it, per group slot.

One dict per group slot maps a content key to the workers whose group in that slot
holds it, as an integer bitset (bit i = worker index i). Bitsets are interned: every
key held by the same set of workers refers to one shared int object (a worker's own
`1 << index` for a single holder), so a block costs a dict entry and no bitset of its
own, and scoring reads a few hot objects instead of one per key. Copies beyond the
first are counted on the side, per worker.
"""

from __future__ import annotations

from collections.abc import Iterable


class InvertedIndex:
    """Per-slot dicts shared by all workers, and the shared bitset objects."""

    __slots__ = ("_interned", "_uses", "bits", "slots")

    def __init__(self) -> None:
        self.slots: list[dict[int, int]] = []
        self.bits: list[int] = []  # 1 << index, one object per worker index
        self._interned: dict[int, int] = {}  # multi-holder bitset -> its shared object
        self._uses: dict[int, int] = {}  # multi-holder bitset -> entries referring to it

    def ensure_slot(self, slot: int) -> None:
        """Create the per-slot dicts up to `slot`."""
        while len(self.slots) <= slot:
            self.slots.append({})

    def bit(self, index: int) -> int:
        """The shared `1 << index` object of a worker index."""
        while len(self.bits) <= index:
            self.bits.append(1 << len(self.bits))
        return self.bits[index]

    def swap(self, old: int, new: int) -> int:
        """An entry's holders change from `old` to `new` (0: none): keep the use counts
        of shared bitsets and return the shared object for `new`."""
        if old & (old - 1):
            n = self._uses[old] - 1
            if n:
                self._uses[old] = n
            else:
                del self._uses[old]
                del self._interned[old]
        if not new & (new - 1):
            return self.bits[new.bit_length() - 1] if new else 0
        self._uses[new] = self._uses.get(new, 0) + 1
        return self._interned.setdefault(new, new)

    def shared_bitsets(self) -> int:
        """Distinct multi-holder bitsets in use."""
        return len(self._interned)

    def holds(self, index: int, slot: int, key: int) -> bool:
        """Whether worker `index` holds `key` in `slot`."""
        if slot >= len(self.slots):
            return False
        return bool(self.slots[slot].get(key, 0) >> index & 1)


class WorkerSink:
    """`PresenceSink` of one worker in the fleet's inverted index."""

    __slots__ = ("_bit", "_dicts", "_extra", "_inv", "_present")

    def __init__(self, inv: InvertedIndex, index: int) -> None:
        self._inv = inv
        self._bit = inv.bit(index)
        self._extra: dict[tuple[int, int], int] = {}  # (slot, key) -> copies, when >= 2
        self._present: list[int] = []  # per slot: keys held
        self._dicts: list[dict[int, int]] = []  # the index's dicts of this worker's slots

    def add_slot(self, slot: int) -> None:
        self._inv.ensure_slot(slot)
        while len(self._present) <= slot:
            self._present.append(0)
            self._dicts.append(self._inv.slots[len(self._dicts)])

    def add(self, slot: int, key: int) -> None:
        d = self._dicts[slot]
        v = d.get(key)
        if v is None:
            d[key] = self._bit
        elif v & self._bit:
            self._extra[slot, key] = self._extra.get((slot, key), 1) + 1
            return
        else:
            d[key] = self._inv.swap(v, v | self._bit)
        self._present[slot] += 1

    def _unset(self, d: dict[int, int], key: int, v: int) -> None:
        rest = self._inv.swap(v, v ^ self._bit)
        if rest:
            d[key] = rest
        else:
            del d[key]

    def discard(self, slot: int, key: int) -> bool:
        d = self._dicts[slot]
        v = d.get(key, 0)
        bit = self._bit
        if not v & bit:
            return False
        if v == bit and not self._extra:  # the common case: the only holder, one copy
            del d[key]
            self._present[slot] -= 1
            return True
        n = self._extra.get((slot, key)) if self._extra else None
        if n is not None:
            if n == 2:
                del self._extra[slot, key]
            else:
                self._extra[slot, key] = n - 1
            return True
        self._unset(d, key, v)
        self._present[slot] -= 1
        return True

    def discard_all(self, slot: int, keys: list[int]) -> list[bool]:
        """`discard` of each key in order, in one call: whether each withdrew a copy."""
        d = self._dicts[slot]
        bit = self._bit
        extra = self._extra
        out: list[bool] = []
        removed = 0
        for key in keys:
            v = d.get(key, 0)
            if not v & bit:
                out.append(False)
                continue
            out.append(True)
            if extra:
                n = extra.get((slot, key))
                if n is not None:  # one of several copies goes; the key stays held
                    if n == 2:
                        del extra[slot, key]
                    else:
                        extra[slot, key] = n - 1
                    continue
            if v == bit:  # the only holder
                del d[key]
            else:
                self._unset(d, key, v)
            removed += 1
        self._present[slot] -= removed
        return out

    def add_all(self, slot: int, keys: list[int]) -> None:
        """`add` of each key in order, in one call."""
        d = self._dicts[slot]
        bit = self._bit
        swap = self._inv.swap
        added = 0
        for key in keys:
            v = d.get(key)
            if v is None:
                d[key] = bit
            elif v & bit:
                self._extra[slot, key] = self._extra.get((slot, key), 1) + 1
                continue
            else:
                d[key] = swap(v, v | bit)
            added += 1
        self._present[slot] += added

    def holds_all(self, keys: list[int]) -> list[bool]:
        """`holds` of each key, in one call."""
        bit = self._bit
        if len(self._dicts) == 1:  # one group: no loop over slots per key
            get = self._dicts[0].get
            return [bool(get(key, 0) & bit) for key in keys]
        return [self.holds(key) for key in keys]

    def holds(self, key: int) -> bool:
        bit = self._bit
        return any(d.get(key, 0) & bit for d in self._dicts)

    def drop(self, key: int) -> None:
        slots = self._inv.slots
        for s in range(len(self._present)):
            d = slots[s]
            v = d.get(key, 0)
            if v & self._bit:
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

    __slots__ = ("_d", "_index")

    def __init__(self, inv: InvertedIndex, index: int, slot: int) -> None:
        inv.ensure_slot(slot)
        self._d = inv.slots[slot]
        self._index = index

    def __contains__(self, key: object) -> bool:
        return bool(self._d.get(key, 0) >> self._index & 1)  # type: ignore[call-overload]
