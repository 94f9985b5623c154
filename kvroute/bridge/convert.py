"""vLLM events (decoded by `kvroute.bridge.vllm_schema`) -> protobuf `KvGroupEvent` /
`KvEventBatch`.

Rules (issue 2, spec §2-§5):
- hashes: an int of any sign is masked to 64 bits and written as 8 bytes big-endian; bytes
  pass through; bool, empty and any other value make the event INVALID;
- tiers (spec §10): local GPU events (medium GPU or absent, locality LOCAL or absent,
  ownership absent) go to `events`; local CPU and STORAGE events (an `ownership` names a
  secondary tier of the same engine) go to `tier_events` with their tier; remote and unknown
  media are dropped, for stores and removes alike. A lower-tier store without tokens (vLLM's
  placeholder payload: a chunk's key hash only) cannot be placed and is dropped and counted;
  its removal passes (a removal of an unknown block is harmless);
- stores are forwarded whole (sparse ones are never sliced by ordinal), duplicates are kept;
- `AllBlocksCleared` -> CLEAR; absent group fields (before 0.20) -> group 0, kind "";
- namespace: `lora_name`; the digest of the cache salt (`kvroute.proto.namespace`, never the
  salt itself) from the extra keys of the block at token 0; any
  other extra key (multimodal, prompt embeddings, unknown), lookahead tokens, or a LoRA known
  only by id make blocks unmatchable. A dense store whose later blocks are unmatchable is
  split at the first such block (dense spans can be cut exactly; sparse ones never are).
"""

from __future__ import annotations

from typing import Any, Final

from kvroute.bridge.vllm_schema import DecodedBatch, DecodedCleared, DecodedRemoved, DecodedStored
from kvroute.proto.events_pb2 import KvEventBatch, KvGroupEvent, Tier
from kvroute.proto.namespace import salt_namespace

STORE: Final = KvGroupEvent.STORE
REMOVE: Final = KvGroupEvent.REMOVE
CLEAR: Final = KvGroupEvent.CLEAR
INVALID: Final = KvGroupEvent.INVALID

_MASK64: Final = (1 << 64) - 1
_UINT32_MAX: Final = (1 << 32) - 1
_LOCAL_LOCALITIES: Final = frozenset({None, "LOCAL"})
GPU: Final = Tier.GPU
# vLLM's `medium` -> tier (absent: the KV cache manager's own events, before 0.10.2)
_TIERS: Final[dict[str | None, int]] = {
    None: Tier.GPU,
    "GPU": Tier.GPU,
    "CPU": Tier.CPU,
    "STORAGE": Tier.STORAGE,
}
TIER_NAMES: Final[dict[int, str]] = {Tier.GPU: "gpu", Tier.CPU: "cpu", Tier.STORAGE: "storage"}


class ConvertStats:
    """Counters a converter adds to (one per stream; read by metrics)."""

    __slots__ = ("filtered", "invalid", "placeholders", "split", "stored_blocks", "unmatchable")

    def __init__(self) -> None:
        self.filtered = 0  # events dropped as remote or of an unknown medium
        self.placeholders: dict[int, int] = {}  # tier -> lower-tier stores without tokens
        self.invalid = 0  # events turned into INVALID
        self.unmatchable = 0  # STOREs marked unmatchable
        self.split = 0  # dense STOREs split at their first unmatchable block
        self.stored_blocks = 0  # hashes in converted STOREs


def normalise_hash(value: Any) -> bytes | None:
    """vLLM hash -> opaque identity bytes, or None if the value cannot be a hash."""
    kind = type(value)
    if kind is int:
        result: bytes = (value & _MASK64).to_bytes(8, "big")
        return result
    if kind is bytes:
        return value if value else None
    return None


def _normalise_all(values: list[Any]) -> list[bytes] | None:
    out: list[bytes] = []
    append = out.append
    for value in values:
        kind = type(value)
        if kind is int:
            append((value & _MASK64).to_bytes(8, "big"))
        elif kind is bytes and value:
            append(value)
        else:
            return None
    return out


def _tier_of(medium: Any, locality: Any, ownership: Any) -> int | None:
    """The tier an event belongs to, or None when kvroute does not keep it."""
    if locality not in _LOCAL_LOCALITIES or type(medium) not in (str, type(None)):
        return None
    tier = _TIERS.get(medium)
    if tier == GPU and ownership is not None:
        return None  # a GPU medium from a secondary tier: not this engine's pool
    return tier


def _target(batch: KvEventBatch, tier: int) -> Any:
    return batch.events if tier == GPU else batch.tier_events


def _mark(out: Any, start: int, tier: int) -> None:
    if tier != GPU:
        for event in out[start:]:
            event.tier = tier


def _first_unmatchable(ev: DecodedStored, salted: list[str]) -> int:
    """Index of the first block whose extra keys kvroute cannot reproduce (len = none).

    Appends a cache salt found on the block at token 0 to `salted`.
    """
    count = len(ev.block_hashes)
    if ev.lora_id is not None and not ev.lora_name:
        return 0  # a LoRA namespace known only by its engine-internal id
    lookahead = ev.lookahead_token_ids
    if lookahead is not None and any(lookahead):
        return 0
    extra = ev.extra_keys
    if not extra:
        return count
    if len(extra) != count:
        return 0
    lora = ev.lora_name
    for index, entry in enumerate(extra):
        if entry is None:
            continue
        if not isinstance(entry, list):
            return index
        items = entry[1:] if lora and entry and entry[0] == lora else entry
        for item in items:
            # The salt is published bare, only on the block that starts at token 0.
            if type(item) is str and index == 0 and ev.parent_block_hash is None:
                salted.append(item)
            else:
                return index
    return count


def _valid_u32(value: Any) -> bool:
    return type(value) is int and 0 <= value <= _UINT32_MAX


def _add_invalid(out: Any, group: Any) -> None:
    event = out.add(operation=INVALID)
    if _valid_u32(group):
        event.group_id = group


def _convert_stored(ev: DecodedStored, batch: KvEventBatch, stats: ConvertStats) -> None:
    tier = _tier_of(ev.medium, ev.locality, ev.ownership)
    if tier is None:
        stats.filtered += 1
        return
    out = _target(batch, tier)
    if tier != GPU and not ev.token_ids and not ev.block_size:
        stats.placeholders[tier] = stats.placeholders.get(tier, 0) + 1
        return
    start = len(out)
    _store(ev, out, stats)
    _mark(out, start, tier)


def _store(ev: DecodedStored, out: Any, stats: ConvertStats) -> None:
    hashes = _normalise_all(ev.block_hashes)
    parent_raw = ev.parent_block_hash
    parent = b"" if parent_raw is None else normalise_hash(parent_raw)
    group = 0 if ev.group_idx is None else ev.group_idx
    window = ev.kv_cache_spec_sliding_window or 0
    block_size = ev.block_size
    if (
        hashes is None
        or parent is None
        or not _valid_u32(group)
        or not _valid_u32(window)
        or not _valid_u32(block_size)
        or block_size == 0
    ):
        stats.invalid += 1
        _add_invalid(out, group)
        return
    salted: list[str] = []
    cut = _first_unmatchable(ev, salted)
    namespace = salt_namespace(salted[0]) if len(salted) == 1 else ""
    if len(salted) > 1:
        cut = 0
    tokens = ev.token_ids
    kind = ev.kv_cache_spec_kind or ""
    lora = ev.lora_name or ""
    count = len(hashes)
    start = len(out)
    try:
        if cut >= count:
            # The common case, field by field: setting only non-default fields is cheaper
            # than keyword construction.
            event = out.add()
            event.operation = STORE
            if group:
                event.group_id = group
            event.block_hashes.extend(hashes)
            if parent:
                event.parent_block_hash = parent
            event.token_ids.extend(tokens)
            event.block_size = block_size
            if kind:
                event.kind = kind
            if window:
                event.sliding_window = window
            if lora:
                event.lora_name = lora
            if namespace:
                event.cache_namespace = namespace
        elif cut > 0 and len(tokens) == count * block_size:
            stats.split += 1
            stats.unmatchable += 1
            split_at = cut * block_size
            common = dict(
                operation=STORE,
                group_id=group,
                block_size=block_size,
                kind=kind,
                sliding_window=window,
                lora_name=lora,
            )
            out.add(
                block_hashes=hashes[:cut],
                parent_block_hash=parent,
                token_ids=tokens[:split_at],
                cache_namespace=namespace,
                **common,
            )
            out.add(
                block_hashes=hashes[cut:],
                parent_block_hash=hashes[cut - 1],
                token_ids=tokens[split_at:],
                unmatchable=True,
                **common,
            )
        else:
            stats.unmatchable += 1
            out.add(
                operation=STORE,
                group_id=group,
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=tokens,
                block_size=block_size,
                kind=kind,
                sliding_window=window,
                lora_name=lora,
                cache_namespace=namespace,
                unmatchable=True,
            )
    except (ValueError, TypeError):
        # A token id outside uint32 (protobuf refuses it): the event cannot be represented.
        del out[start:]
        stats.invalid += 1
        _add_invalid(out, group)
        return
    stats.stored_blocks += count


def _convert_removed(ev: DecodedRemoved, batch: KvEventBatch, stats: ConvertStats) -> None:
    tier = _tier_of(ev.medium, ev.locality, ev.ownership)
    if tier is None:
        stats.filtered += 1
        return
    out = _target(batch, tier)
    start = len(out)
    hashes = _normalise_all(ev.block_hashes)
    group = 0 if ev.group_idx is None else ev.group_idx
    if hashes is None or not _valid_u32(group):
        stats.invalid += 1
        _add_invalid(out, group)
    else:
        out.add(operation=REMOVE, group_id=group, block_hashes=hashes)
    _mark(out, start, tier)


def convert_batch(
    decoded: DecodedBatch,
    seq: int,
    *,
    dp_rank: int | None = None,
    stats: ConvertStats | None = None,
) -> KvEventBatch:
    """One decoded vLLM batch -> `KvEventBatch` with the engine's seq and ts verbatim.

    `dp_rank` defaults to the batch's own `data_parallel_rank` (0 if absent); the bridge passes
    the rank of the socket it read from. Events that cannot be converted become INVALID
    events in place; filtered events are dropped; counters go to `stats` if given.
    """
    counters = ConvertStats() if stats is None else stats
    rank = decoded.data_parallel_rank if dp_rank is None else dp_rank
    batch = KvEventBatch(sequence=seq, timestamp=decoded.ts)
    if rank is not None and _valid_u32(rank):
        batch.dp_rank = rank
    for ev in decoded.events:
        if isinstance(ev, DecodedStored):
            _convert_stored(ev, batch, counters)
        elif isinstance(ev, DecodedRemoved):
            _convert_removed(ev, batch, counters)
        elif isinstance(ev, DecodedCleared):
            batch.events.add(operation=CLEAR)
    return batch
