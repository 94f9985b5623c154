"""A bounded cache of token ids for text prefixes, so a conversation's history is tokenized once.

A record remembers, for a prompt that was tokenized, the ids of its text up to several anchors
(cuts where tokenization splits exactly, see `encoder`): the last one near the text's end, and
checkpoints further back, so a later prompt that departs from this one shortly before its end
(an edited last message, a trace whose last block differs) still reuses all the text before
the departure. Each anchor is a *mark*; a later prompt that starts with the same text *through
a mark's anchor and a guard region after it* (the characters that decide whether the
tokenizer cuts there) reuses the ids up to that anchor and tokenizes only from it on. A
record's marks share one ids array: the ids up to an earlier mark are a prefix of it.

Finding the longest cached prefix of a new text without comparing it to every record: texts
are hashed in fixed chunks (xxh3-128, chained), giving one digest per chunk boundary. A mark
is filed under the digest of the last chunk boundary before its anchor, plus the characters
from that boundary to the end of the guard region (its tail). A lookup walks the new text's
boundaries from the end and takes the first bucket whose tail matches, which is the mark with
the longest usable prefix. Cost per lookup: one hashing pass and one dict probe per chunk.

Bounded by records and by bytes (ids are stored as 4-byte arrays, tails as 4 bytes per
character); least recently used records are evicted first, all their marks with them.
Thread-safe.

Tenants are kept apart by the digests' seed: a request's `cache_salt` and LoRA adapter name
(`tenant_key`) derive it, so the same text of two tenants files two records and one tenant's
look-up can never hit (nor be timed against) another's.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

CHUNK_CHARS = 256
_ENTRY_OVERHEAD = 200  # bytes counted per entry for its bookkeeping


@dataclass(slots=True)
class _Record:
    ids: array  # type: ignore[type-arg]  # ids of the text up to the last mark's anchor
    marks: list[_Mark]
    nbytes: int


@dataclass(slots=True)
class _Mark:
    key: tuple[int, int]  # (chunk boundary, digest of text[:boundary])
    tail: str  # text[boundary:anchor + guard]
    anchor: int  # character position of the anchor
    n_ids: int  # ids of text[:anchor]: record.ids[:n_ids]
    record: _Record


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
    entries: int  # records
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
    """Ids of text prefixes, LRU-bounded by `max_entries` records and `max_bytes`."""

    def __init__(self, max_entries: int, max_bytes: int, chunk: int = CHUNK_CHARS) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("cache bounds must be >= 0")
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._chunk = chunk
        self._lock = threading.Lock()
        # records by their last mark's (key, tail): the same text inserted again replaces one
        self._lru: OrderedDict[tuple[tuple[int, int], str], _Record] = OrderedDict()
        self._buckets: dict[tuple[int, int], dict[str, _Mark]] = {}
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
                best: _Mark | None = None
                for mark in bucket.values():
                    if (best is None or mark.anchor > best.anchor) and text.startswith(
                        mark.tail, boundary
                    ):
                        best = mark
                if best is not None:
                    rec = best.record
                    last = rec.marks[-1]
                    self._lru.move_to_end((last.key, last.tail))
                    ids = rec.ids if best.n_ids == len(rec.ids) else rec.ids[: best.n_ids]
                    return CacheHit(anchor=best.anchor, ids=ids)
        return None

    def insert(
        self,
        text: str,
        digests: list[int],
        ids: Sequence[int],
        marks: Sequence[tuple[int, int]],
        guard: int,
    ) -> None:
        """Remember, for each `(anchor, n)` of `marks`, that text[:anchor] tokenizes to
        `ids[:n]`, valid for any text that shares text[:anchor + guard]. Anchors increase and
        the last `n` is len(ids)."""
        if not marks or guard < 1:
            raise ValueError("need at least one mark and guard >= 1")
        anchors = [a for a, _ in marks]
        counts = [n for _, n in marks]
        if anchors != sorted(set(anchors)) or counts != sorted(counts) or counts[-1] != len(ids):
            raise ValueError("marks must increase and end at len(ids)")
        if anchors[0] < 0 or anchors[-1] + guard > len(text):
            raise ValueError("need 0 <= anchor and anchor + guard <= len(text)")
        if self._max_entries == 0:
            return
        stored = array("I", ids)
        rec = _Record(ids=stored, marks=[], nbytes=stored.itemsize * len(stored))
        for anchor, n in marks:
            boundary = anchor // self._chunk * self._chunk
            key = (boundary, digests[anchor // self._chunk])
            tail = text[boundary : anchor + guard]
            rec.marks.append(_Mark(key=key, tail=tail, anchor=anchor, n_ids=n, record=rec))
            rec.nbytes += len(tail) * 4 + _ENTRY_OVERHEAD
        if rec.nbytes > self._max_bytes:
            return
        last = rec.marks[-1]
        with self._lock:
            old = self._lru.pop((last.key, last.tail), None)
            if old is not None:
                self._forget(old)
            self._lru[(last.key, last.tail)] = rec
            for mark in rec.marks:
                self._buckets.setdefault(mark.key, {})[mark.tail] = mark
            self._bytes += rec.nbytes
            while len(self._lru) > self._max_entries or self._bytes > self._max_bytes:
                _, victim = self._lru.popitem(last=False)
                self._forget(victim)
                self._evictions += 1

    def _forget(self, rec: _Record) -> None:
        """Drop `rec`'s marks (those another record has not taken over) and its bytes."""
        for mark in rec.marks:
            bucket = self._buckets.get(mark.key)
            if bucket is not None and bucket.get(mark.tail) is mark:
                del bucket[mark.tail]
                if not bucket:
                    del self._buckets[mark.key]
        self._bytes -= rec.nbytes

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()
            self._buckets.clear()
            self._bytes = 0

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(entries=len(self._lru), bytes=self._bytes, evictions=self._evictions)
