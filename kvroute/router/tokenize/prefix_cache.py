"""A bounded cache of token ids for text prefixes, so a conversation's history is tokenized once.

An entry remembers, for a rendered prompt that was tokenized, the ids of its text up to an
anchor (a cut where tokenization splits exactly, see `encoder`). A later prompt that starts with
that same text *through the anchor and a guard region after it* (the characters that decide
whether the tokenizer matches the anchor there) reuses the ids and tokenizes only from the
anchor on.

Finding the longest cached prefix of a new text without comparing it to every entry: texts are
hashed in fixed chunks (xxh3-128, chained), giving one digest per chunk boundary. An entry is
filed under the digest of the last chunk boundary before its anchor, plus the characters from
that boundary to the end of the guard region (its tail). A lookup walks the new text's
boundaries from the end and takes the first bucket whose tail matches, which is the entry with
the longest usable prefix. Cost per lookup: one hashing pass and one dict probe per chunk.

Bounded by entries and by bytes (ids are stored as 4-byte arrays); least recently used entries
are evicted first. Thread-safe.

Tenants are kept apart by the digests' seed: a request's `cache_salt` and LoRA adapter name
(`tenant_key`) derive it, so the same text of two tenants files two entries and one tenant's
look-up can never hit (nor be timed against) another's.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import xxhash

CHUNK_CHARS = 256
_ENTRY_OVERHEAD = 200  # bytes counted per entry for its bookkeeping


@dataclass(slots=True)
class _Entry:
    key: tuple[int, int]  # (chunk boundary, digest of text[:boundary])
    tail: str  # text[boundary:guard_end]
    anchor: int  # character position of the anchor (< guard_end)
    ids: array  # type: ignore[type-arg]  # ids of text[:anchor]
    nbytes: int


@dataclass(frozen=True, slots=True)
class CacheHit:
    anchor: int  # text[:anchor] is known
    # its ids, as stored: a routing decision hashes them as they are (`content_keys` takes
    # an array("I") without a copy), so a long conversation is not turned into a list first
    ids: array[int]


@dataclass(frozen=True, slots=True)
class Lookup:
    """One text's look-up: its chunk digests (which an insert needs too) and the hit."""

    digests: list[int]
    hit: CacheHit | None

    def uncached_chars(self, text: str) -> int:
        """Characters of `text` (the looked-up text) beyond the hit."""
        return len(text) - (self.hit.anchor if self.hit is not None else 0)


@dataclass(frozen=True, slots=True)
class CacheStats:
    entries: int
    bytes: int
    evictions: int


def chunk_digests(text: str, chunk: int = CHUNK_CHARS, seed: int = 0) -> list[int]:
    """digests[k] = hash of text[:k*chunk] for every chunk boundary up to len(text); the seed
    keeps the texts of different tokenizers apart."""
    h = xxhash.xxh3_128(seed=seed)
    out = [h.intdigest()]
    for start in range(0, len(text) - chunk + 1, chunk):
        h.update(text[start : start + chunk].encode("utf-8", "surrogatepass"))
        out.append(h.intdigest())
    return out


def tenant_key(lora_name: str, cache_salt: str) -> bytes:
    """What keeps one tenant's entries apart from another's: b"" for an unsalted request on a
    base model (those share entries, as the engine shares their KV cache)."""
    if not lora_name and not cache_salt:
        return b""
    lora = lora_name.encode("utf-8", "surrogatepass")
    return b"%d:%s%s" % (len(lora), lora, cache_salt.encode("utf-8", "surrogatepass"))


def tenant_seed(seed: int, tenant: bytes) -> int:
    """The digest seed of `tenant`'s texts under a tokenizer's `seed` (`seed` itself for the
    shared tenant b""). A keyed BLAKE2b, so a tenant who does not know another's salt cannot
    pick a text whose digests collide with that tenant's entries."""
    if not tenant:
        return seed
    key = seed.to_bytes(8, "little", signed=False)
    return int.from_bytes(hashlib.blake2b(tenant, digest_size=8, key=key).digest(), "little")


class PrefixCache:
    """Ids of text prefixes, LRU-bounded by `max_entries` and `max_bytes`."""

    def __init__(self, max_entries: int, max_bytes: int, chunk: int = CHUNK_CHARS) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("cache bounds must be >= 0")
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._chunk = chunk
        self._lock = threading.Lock()
        self._lru: OrderedDict[tuple[tuple[int, int], str], _Entry] = OrderedDict()
        self._buckets: dict[tuple[int, int], dict[str, _Entry]] = {}
        self._bytes = 0
        self._evictions = 0

    def digests(self, text: str, seed: int = 0) -> list[int]:
        return chunk_digests(text, self._chunk, seed)

    def lookup(self, text: str, digests: list[int]) -> CacheHit | None:
        """The cached prefix of `text` with the largest anchor, if any."""
        with self._lock:
            for k in range(len(digests) - 1, -1, -1):
                boundary = k * self._chunk
                bucket = self._buckets.get((boundary, digests[k]))
                if not bucket:
                    continue
                best: _Entry | None = None
                for entry in bucket.values():
                    if (best is None or entry.anchor > best.anchor) and text.startswith(
                        entry.tail, boundary
                    ):
                        best = entry
                if best is not None:
                    self._lru.move_to_end((best.key, best.tail))
                    return CacheHit(anchor=best.anchor, ids=best.ids)
        return None

    def insert(
        self, text: str, digests: list[int], anchor: int, guard_end: int, ids: list[int]
    ) -> None:
        """Remember that text[:anchor] tokenizes to `ids`, valid for any text that shares
        text[:guard_end] (guard_end > anchor)."""
        if not anchor < guard_end <= len(text):
            raise ValueError("need anchor < guard_end <= len(text)")
        k = anchor // self._chunk
        boundary = k * self._chunk
        key = (boundary, digests[k])
        tail = text[boundary:guard_end]
        stored = array("I", ids)
        nbytes = stored.itemsize * len(stored) + len(tail) * 4 + _ENTRY_OVERHEAD
        if nbytes > self._max_bytes or self._max_entries == 0:
            return
        entry = _Entry(key=key, tail=tail, anchor=anchor, ids=stored, nbytes=nbytes)
        with self._lock:
            old = self._lru.pop((key, tail), None)
            if old is not None:
                self._bytes -= old.nbytes
            self._lru[(key, tail)] = entry
            self._buckets.setdefault(key, {})[tail] = entry
            self._bytes += nbytes
            while len(self._lru) > self._max_entries or self._bytes > self._max_bytes:
                (okey, otail), victim = self._lru.popitem(last=False)
                bucket = self._buckets[okey]
                del bucket[otail]
                if not bucket:
                    del self._buckets[okey]
                self._bytes -= victim.nbytes
                self._evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()
            self._buckets.clear()
            self._bytes = 0

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(entries=len(self._lru), bytes=self._bytes, evictions=self._evictions)
