"""Block hashes: a chain over hash-unit token chunks, like vLLM's, with our own encoding.

hash_i = sha256(parent_digest || chunk token ids || extra keys). The parent of the first chunk
is a fixed seed digest. Extra keys follow vLLM's order and tagging inside the hash: LoRA
("lora", name, path) on every chunk, ("cache_salt", salt) only on the chunk starting at 0.
On the wire a hash is the digest's low 64 bits as an int (vLLM's default int mode).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any

Digest = bytes

NONE_HASH: Digest = hashlib.sha256(b"kvroute-sim-none-hash").digest()


def _encode_extra(extra: tuple[Any, ...] | None) -> bytes:
    if extra is None:
        return b"\x00"
    return b"\x01" + repr(extra).encode("utf-8")


def chunk_hash(
    parent: Digest | None, tokens: Sequence[int], extra: tuple[Any, ...] | None
) -> Digest:
    """The digest of one hash-unit chunk chained on its parent's digest."""
    h = hashlib.sha256(parent or NONE_HASH)
    h.update(struct.pack(f">I{len(tokens)}I", len(tokens), *tokens))
    h.update(_encode_extra(extra))
    return h.digest()


def block_digest(hashes: Sequence[Digest], unit: int, block_size: int, i: int) -> Digest:
    """Hash of a group's block i: the chain hash at its last hash-unit boundary (§4.4)."""
    return hashes[(i + 1) * (block_size // unit) - 1]


def external(digest: Digest) -> int:
    """The wire form of a hash: low 64 bits, unsigned (vLLM's int mode)."""
    return int.from_bytes(digest[-8:], "big")


def hash_extra_keys(
    start: int, lora_name: str | None, lora_path: str | None, cache_salt: str | None
) -> tuple[Any, ...] | None:
    """Tagged extra keys that go into the hash of the chunk/block starting at `start`."""
    keys: list[tuple[str, ...]] = []
    if lora_name:
        keys.append(("lora", lora_name, lora_path or ""))
    if start == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def event_extra_keys(tagged: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """What events publish for one block: the same keys untagged (LoRA path dropped)."""
    if tagged is None:
        return None
    return tuple(key[1] for key in tagged)
