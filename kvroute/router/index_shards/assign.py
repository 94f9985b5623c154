"""Which shard owns a worker: a stable hash of its name, the same in every router process and
across restarts (Python's own `hash` of a str is salted per process)."""

from __future__ import annotations

import hashlib


def shard_of(name: str, shards: int) -> int:
    """The shard (0 .. shards-1) that owns worker `name`."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards
