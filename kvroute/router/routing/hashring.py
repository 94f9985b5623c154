"""Consistent hashing with bounded load (Mirrokni, Thorup, Zadimoghaddam 2018).

A session key maps to a point on a ring of virtual nodes; the request goes to the first worker
clockwise that is eligible and whose load is below `bound` times the mean load (plus one), so a
hot session cannot pile onto one worker, and adding or removing a worker moves only the keys
next to its points.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping

import xxhash


def _point(text: str) -> int:
    return int(xxhash.xxh3_64_intdigest(text.encode("utf-8")))


class HashRing:
    """The ring of worker points; membership changes are O(virtual_nodes log n)."""

    def __init__(self, virtual_nodes: int = 64) -> None:
        self._vnodes = virtual_nodes
        self._points: list[int] = []
        self._owners: list[str] = []
        self._members: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self._members

    def __len__(self) -> int:
        return len(self._members)

    def add(self, name: str) -> None:
        if name in self._members:
            return
        self._members.add(name)
        for i in range(self._vnodes):
            p = _point(f"{name}#{i}")
            at = bisect.bisect_left(self._points, p)
            self._points.insert(at, p)
            self._owners.insert(at, name)

    def remove(self, name: str) -> None:
        if name not in self._members:
            return
        self._members.discard(name)
        keep = [(p, o) for p, o in zip(self._points, self._owners, strict=True) if o != name]
        self._points = [p for p, _ in keep]
        self._owners = [o for _, o in keep]

    def lookup(
        self,
        key: str,
        eligible: Callable[[str], bool],
        load: Mapping[str, int],
        bound: float = 1.25,
    ) -> str | None:
        """The worker for `key`: first eligible one clockwise whose load stays under the bound.

        `load` is in-flight requests per worker (missing = 0). None when nothing is eligible.
        """
        if not self._points:
            return None
        candidates = {m for m in self._members if eligible(m)}
        if not candidates:
            return None
        total = sum(load.get(m, 0) for m in candidates)
        capacity = math.ceil(bound * (total + 1) / len(candidates))
        start = bisect.bisect_left(self._points, _point(key))
        seen: set[str] = set()
        n = len(self._points)
        for step in range(n):
            owner = self._owners[(start + step) % n]
            if owner in seen:
                continue
            seen.add(owner)
            if owner in candidates and load.get(owner, 0) + 1 <= capacity:
                return owner
            if len(seen) == len(self._members):
                break
        # Unreachable in theory (someone is at or below the mean); stay total anyway.
        # (sorted: set order depends on the process's hash seed; replicas must agree)
        return min(sorted(candidates), key=lambda m: load.get(m, 0))
