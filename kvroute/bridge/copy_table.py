"""Block key -> the records holding its copies, packed (the bridge keeps millions of them).

A block hash is kept as a *key*: an 8-byte hash (vLLM's int mode, every hash the converter
emits) becomes the int `int.from_bytes(hash, sys.byteorder)`, any other length stays bytes.
A record is named by its *slot*, a small int the state hands out and reuses.

`CopyTable` maps key -> slots, one per copy, oldest first. Nonzero int keys live in an
open-addressing table (linear probing, backward-shift deletion, no tombstones) of two
parallel arrays: 8-byte keys and 4-byte slots, 12 bytes a slot at a load of 3/8 to 3/4,
where a dict entry plus its key object costs about 90. Keys with more than one copy keep
their slots in `multi` (the array holds MULTI for them); the key 0 and bytes keys go to
the plain dict `other`. Copy order: `pop` withdraws the newest copy; `discard` one held
by a given slot (the oldest of that slot's).

Growing (doubling, at 3/4 full) re-inserts every key in Python: a pause of about 1.2 s at
1.5M keys of one group on one core, once per doubling (a dict resizes in C, ~0.1 s).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from itertools import compress
from typing import Final

Key = int | bytes
ORDER: Final = sys.byteorder
MULTI: Final = 0xFFFFFFFF  # slot value meaning "several copies: see multi"
MAX_SLOT: Final = MULTI - 1
_MIN_CAPACITY: Final = 15


def key_of(block_hash: bytes) -> Key:
    """The key of a block hash (see the module docstring)."""
    return int.from_bytes(block_hash, ORDER) if len(block_hash) == 8 else block_hash


def keys_of(hashes: Iterable[bytes]) -> array[int] | list[Key]:
    """Keys of a run of hashes: an array('Q') if all are 8 bytes (the usual case)."""
    items = hashes if isinstance(hashes, list) else list(hashes)
    joined = b"".join(items)
    count = len(items)
    # Total 8 per hash and none shorter: all have 8 bytes.
    if count and len(joined) == 8 * count and (count == 1 or min(map(len, items)) == 8):
        return array("Q", joined)
    return [key_of(block_hash) for block_hash in items]


def hash_of(key: Key) -> bytes:
    """The block hash of a key."""
    return key.to_bytes(8, ORDER) if isinstance(key, int) else key


def hashes_of(keys: array[int] | list[Key]) -> list[bytes]:
    """Block hashes of keys, in order."""
    if isinstance(keys, array):
        raw = keys.tobytes()
        return [raw[i : i + 8] for i in range(0, len(raw), 8)]
    return [hash_of(key) for key in keys]


class CopyTable:
    """key -> slots of the records holding its copies (see the module docstring)."""

    __slots__ = ("_cap", "_keys", "_limit", "_slots", "_used", "multi", "other")

    def __init__(self) -> None:
        self._alloc(_MIN_CAPACITY)
        self._used = 0
        self.multi: dict[int, list[int]] = {}  # packed keys with several copies
        self.other: dict[Key, int | list[int]] = {}  # key 0 and bytes keys

    def _alloc(self, capacity: int) -> None:
        self._cap = capacity  # odd: a key's home is key % capacity
        self._limit = capacity * 3 // 4
        self._keys = array("Q", bytes(8 * capacity))
        self._slots = array("I", bytes(4 * capacity))

    def __len__(self) -> int:
        """Distinct keys held."""
        return self._used + len(self.other)

    def _find(self, key: int) -> int:
        """Index of a packed key, or -1."""
        keys, cap = self._keys, self._cap
        index = key % cap
        while True:
            found = keys[index]
            if found == key:
                return index
            if found == 0:
                return -1
            index += 1
            if index == cap:
                index = 0

    def _grow(self) -> None:
        old = list(compress(zip(self._keys, self._slots, strict=True), self._keys))
        self._alloc(self._cap * 2 + 1)
        keys, slots, cap = self._keys, self._slots, self._cap
        for key, slot in old:
            index = key % cap
            while keys[index]:
                index += 1
                if index == cap:
                    index = 0
            keys[index] = key
            slots[index] = slot

    def _delete_at(self, index: int) -> None:
        """Empty `index`, shifting back the keys after it that probed past it."""
        keys, slots, cap = self._keys, self._slots, self._cap
        keys[index] = 0
        self._used -= 1
        probe = index
        while True:
            probe += 1
            if probe == cap:
                probe = 0
            key = keys[probe]
            if key == 0:
                return
            home = key % cap
            # `key` may stay unless the hole lies cyclically within [home, probe).
            if (index < probe and index < home <= probe) or (
                index > probe and (home > index or home <= probe)
            ):
                continue
            keys[index] = key
            slots[index] = slots[probe]
            keys[probe] = 0
            index = probe

    def add(self, keys: array[int] | list[Key], slot: int) -> None:
        """One more copy of each key (repeats add several), held by `slot`."""
        while self._used + len(keys) > self._limit:
            self._grow()
        if not isinstance(keys, array) or 0 in keys:
            for key in keys:
                self._add_one(key, slot)
            return
        table, slots, cap, used = self._keys, self._slots, self._cap, self._used
        for key in keys:  # the usual case: nonzero 8-byte keys, mostly new
            index = key % cap
            found = table[index]
            while found != 0 and found != key:
                index += 1
                if index == cap:
                    index = 0
                found = table[index]
            if found == 0:
                table[index] = key
                slots[index] = slot
                used += 1
            else:  # another copy of a key held
                self._used = used
                self._add_one(key, slot)
                table, slots, cap, used = self._keys, self._slots, self._cap, self._used
        self._used = used

    def _add_one(self, key: Key, slot: int) -> None:
        if not key or not isinstance(key, int):
            held = self.other.get(key)
            if held is None:
                self.other[key] = slot
            elif isinstance(held, list):
                held.append(slot)
            else:
                self.other[key] = [held, slot]
            return
        if self._used >= self._limit:
            self._grow()
        index = self._find(key)
        if index < 0:
            table, cap = self._keys, self._cap
            index = key % cap
            while table[index]:
                index += 1
                if index == cap:
                    index = 0
            table[index] = key
            self._slots[index] = slot
            self._used += 1
            return
        held_slot = self._slots[index]
        if held_slot == MULTI:
            self.multi[key].append(slot)
        else:
            self.multi[key] = [held_slot, slot]
            self._slots[index] = MULTI

    def holders(self, key: Key) -> list[int]:
        """Slots holding copies of `key`, oldest copy first ([] if none)."""
        if not isinstance(key, int) or key == 0:
            held = self.other.get(key)
            if held is None:
                return []
            return held if isinstance(held, list) else [held]
        index = self._find(key)
        if index < 0:
            return []
        slot = self._slots[index]
        return self.multi[key] if slot == MULTI else [slot]

    def count(self, key: Key) -> int:
        """Copies of `key`."""
        return len(self.holders(key))

    def pop(self, key: Key) -> int | None:
        """Withdraw the newest copy of `key`: its slot, or None if there is none."""
        if not isinstance(key, int) or key == 0:
            held = self.other.get(key)
            if held is None:
                return None
            if not isinstance(held, list):
                del self.other[key]
                return held
            slot = held.pop()
            if len(held) == 1:
                self.other[key] = held[0]
            return slot
        index = self._find(key)
        if index < 0:
            return None
        slot = self._slots[index]
        if slot != MULTI:
            self._delete_at(index)
            return slot
        several = self.multi[key]
        slot = several.pop()
        if len(several) == 1:
            self._slots[index] = several[0]
            del self.multi[key]
        return slot

    def discard(self, key: Key, slot: int) -> bool:
        """Withdraw one copy of `key` held by `slot` (its oldest); False if it holds none."""
        if not isinstance(key, int) or key == 0:
            held = self.other.get(key)
            if held is None:
                return False
            if not isinstance(held, list):
                if held != slot:
                    return False
                del self.other[key]
                return True
            if slot not in held:
                return False
            held.remove(slot)
            if len(held) == 1:
                self.other[key] = held[0]
            return True
        index = self._find(key)
        if index < 0:
            return False
        held_slot = self._slots[index]
        if held_slot != MULTI:
            if held_slot != slot:
                return False
            self._delete_at(index)
            return True
        several = self.multi[key]
        if slot not in several:
            return False
        several.remove(slot)
        if len(several) == 1:
            self._slots[index] = several[0]
            del self.multi[key]
        return True
