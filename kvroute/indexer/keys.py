"""Content keys: the router's own identity for a cached prefix.

A key commits to every token before its position and to the namespace the tokens were
cached under. It is a chain of xxh3_64 over fixed units of `hash_unit` tokens (token ids
as little-endian uint32), seeded by the namespace. The unit count (the position in
units) is folded into the high bits, so a key also tells where it ends:

    key = position_in_units << 64 | chained_xxh3_64

vLLM's own hashes are never recomputed (algorithm, seed and extra keys vary by version
and deployment); they are only opaque identities used to link and remove blocks.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from operator import or_
from struct import iter_unpack

import xxhash

MASK64 = (1 << 64) - 1
_xxh3 = xxhash.xxh3_64_intdigest
_TOKEN_BYTES = 4  # token ids are hashed as uint32


@dataclass(frozen=True, slots=True)
class Namespace:
    """What a block was cached under besides its tokens: LoRA adapter and cache salt.

    `cache_salt` is opaque here: the events' `cache_namespace` (a digest of the tenant's salt,
    `kvroute.proto.namespace`), and the router passes the same digest of a request's salt.
    `Namespace()` (or `None` where accepted) is the default namespace.
    """

    lora_name: str = ""
    cache_salt: str = ""


DEFAULT_NAMESPACE = Namespace()


@lru_cache(maxsize=4096)
def _seed(lora_name: str, cache_salt: str) -> int:
    if not lora_name and not cache_salt:
        return 0
    blob = b"kvroute-ns\x00" + lora_name.encode() + b"\x00" + cache_salt.encode()
    return _xxh3(blob)


def namespace_seed(namespace: Namespace | None) -> int:
    """The chain seed of a namespace (0 for the default namespace)."""
    if namespace is None:
        return 0
    return _seed(namespace.lora_name, namespace.cache_salt)


def tokens_to_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; ids outside [0, 2**32) raise ValueError.
    An `array("I")` is taken as is (the cheapest input)."""
    if isinstance(token_ids, array) and token_ids.typecode == "I":
        return token_ids.tobytes()
    buf = array("I")
    try:
        buf.fromlist(token_ids if isinstance(token_ids, list) else list(token_ids))
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
    if buf.itemsize != _TOKEN_BYTES:  # pragma: no cover - exotic platforms
        raise RuntimeError("array('I') is not 32-bit on this platform")
    return buf.tobytes()


# position_in_units << 64 for the first units, so building a key is one `|`.
_SHIFTS: list[int] = [(i + 1) << 64 for i in range(4096)]


def _shifts(start_units: int, count: int) -> list[int]:
    end = start_units + count
    if end > len(_SHIFTS):
        _SHIFTS.extend((i + 1) << 64 for i in range(len(_SHIFTS), end + 1024))
    return _SHIFTS[start_units:end]


def chain_keys(data: bytes, start_units: int, seed: int, hash_unit: int) -> list[int]:
    """Keys for every full unit of `data` (uint32 tokens), continuing a chain.

    `seed` is the low 64 bits of the key just before the span (or a namespace seed at
    token 0) and `start_units` its position in units.
    """
    step = hash_unit * _TOKEN_BYTES
    count = len(data) // step
    out = [0] * count
    h = seed
    for i, (chunk,) in enumerate(iter_unpack(f"{step}s", data[: count * step])):
        h = _xxh3(chunk, h)
        out[i] = h
    return list(map(or_, _shifts(start_units, count), out))


def content_keys(
    token_ids: Sequence[int], namespace: Namespace | None = None, hash_unit: int = 16
) -> list[int]:
    """The request's content keys: key i commits to tokens [0, (i+1)*hash_unit) and the
    namespace. Trailing tokens that do not fill a unit get no key."""
    if hash_unit <= 0:
        raise ValueError("hash_unit must be positive")
    n = len(token_ids) - len(token_ids) % hash_unit
    data = tokens_to_bytes(token_ids[:n] if n != len(token_ids) else token_ids)
    return chain_keys(data, 0, namespace_seed(namespace), hash_unit)


def key_units(key: int) -> int:
    """The end position of a key, in units."""
    return key >> 64
