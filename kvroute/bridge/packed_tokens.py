"""Token ids packed in 2, 3 or 4 bytes each (the bridge keeps millions of them).

A packed span is a `bytearray` (appendable) or `bytes` plus its width. The width is the
smallest that fits the largest id: 2 bytes below 65,536, 3 below 16,777,216, else 4.
Packing and unpacking are strided slice copies done in C, not per-token Python loops.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

_LITTLE = sys.byteorder == "little"


def width_for(largest: int) -> int:
    """Bytes per token needed for ids up to `largest`."""
    if largest < 1 << 16:
        return 2
    if largest < 1 << 24:
        return 3
    return 4


def _raw(values: array[int]) -> bytes:
    if not _LITTLE:
        values = array("I", values)
        values.byteswap()
    return values.tobytes()


def _narrow(raw: bytes, width: int) -> bytearray:
    """Little-endian 4-byte ids -> `width`-byte ids."""
    count = len(raw) // 4
    out = bytearray(count * width)
    for byte in range(width):
        out[byte::width] = raw[byte::4]
    return out


def pack(tokens: Iterable[int], width: int = 0) -> tuple[bytearray, int]:
    """(packed bytes, width); `width` 0 picks the smallest that fits."""
    values = array("I", tokens)
    needed = width_for(max(values)) if values else 2
    width = max(width, needed)
    return _narrow(_raw(values), width), width


def append(packed: bytearray, width: int, tokens: Iterable[int]) -> tuple[bytearray, int]:
    """Append tokens; returns the (possibly re-packed, wider) buffer and its width."""
    values = array("I", tokens)
    if values and width_for(max(values)) > width:
        wider, new_width = pack(unpack(packed, width), width_for(max(values)))
        wider += _narrow(_raw(values), new_width)
        return wider, new_width
    packed += _narrow(_raw(values), width)
    return packed, width


def count(packed: bytes | bytearray, width: int) -> int:
    """Number of tokens in a packed span."""
    return len(packed) // width


def unpack(
    packed: bytes | bytearray, width: int, start: int = 0, stop: int | None = None
) -> array[int]:
    """Tokens [start, stop) of a packed span as an array of unsigned ints."""
    end = len(packed) if stop is None else stop * width
    part = packed[start * width : end]
    n = len(part) // width
    raw = bytearray(n * 4)
    for byte in range(width):
        raw[byte::4] = part[byte::width]
    values = array("I")
    values.frombytes(bytes(raw))
    if not _LITTLE:
        values.byteswap()
    return values
