"""Presence for one worker on its own: a dict per group slot, content key -> copies."""

from __future__ import annotations

from collections.abc import Container, Iterable


class DictSink:
    """`PresenceSink` for a standalone `GroupCache`."""

    __slots__ = ("slots",)

    def __init__(self) -> None:
        self.slots: list[dict[int, int]] = []

    def add_slot(self, slot: int) -> None:
        while len(self.slots) <= slot:
            self.slots.append({})

    def add(self, slot: int, key: int) -> None:
        d = self.slots[slot]
        d[key] = d.get(key, 0) + 1

    def discard(self, slot: int, key: int) -> bool:
        d = self.slots[slot]
        n = d.get(key)
        if not n:
            return False
        if n == 1:
            del d[key]
        else:
            d[key] = n - 1
        return True

    def discard_all(self, slot: int, keys: list[int]) -> list[bool]:
        return [self.discard(slot, key) for key in keys]

    def add_all(self, slot: int, keys: list[int]) -> None:
        for key in keys:
            self.add(slot, key)

    def holds_all(self, keys: list[int]) -> list[bool]:
        return [self.holds(key) for key in keys]

    def holds(self, key: int) -> bool:
        return any(key in d for d in self.slots)

    def drop(self, key: int) -> None:
        for d in self.slots:
            d.pop(key, None)

    def clear(self, keys: Iterable[int]) -> None:
        del keys  # every key of this worker goes
        for d in self.slots:
            d.clear()

    def present(self, slot: int) -> int:
        return len(self.slots[slot]) if slot < len(self.slots) else 0


class AllOf:
    """Held by every one of several containers (a unit of several groups)."""

    __slots__ = ("_parts",)

    def __init__(self, parts: list[Container[int]]) -> None:
        self._parts = parts

    def __contains__(self, key: object) -> bool:
        return all(key in part for part in self._parts)
