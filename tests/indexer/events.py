"""Builders for protobuf group events, and an engine-side block hasher for tests.

`engine_hashes` plays vLLM's part: a chain over hash units (here sha256 over the parent
digest, the unit's tokens and the namespace), keyed by the last unit of each block, so
that equal prefixes give equal hashes. Its exact algorithm is irrelevant to kvroute,
which treats hashes as opaque.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvroute.proto import events_pb2 as pb

STORE = pb.KvGroupEvent.STORE
REMOVE = pb.KvGroupEvent.REMOVE
CLEAR = pb.KvGroupEvent.CLEAR
INVALID = pb.KvGroupEvent.INVALID

FULL = "full_attention"
SWA = "sliding_window"
MAMBA = "mamba"


def engine_hashes(
    tokens: Sequence[int], unit: int = 16, lora: str = "", salt: str = "", extra: str = ""
) -> list[bytes]:
    """One 8-byte hash per full unit of `tokens` (the engine's hash_block_size)."""
    out = []
    parent = b"none-hash" + lora.encode() + b"|" + extra.encode()
    for i in range(len(tokens) // unit):
        chunk = ",".join(map(str, tokens[i * unit : (i + 1) * unit])).encode()
        salt_part = salt.encode() if i == 0 else b""
        parent = hashlib.sha256(parent + b"|" + chunk + b"|" + salt_part).digest()[-8:]
        out.append(parent)
    return out


def block_hashes(fine: Sequence[bytes], block_size: int, unit: int = 16) -> list[bytes]:
    """Hashes of whole blocks: the fine hash at each block's last unit."""
    k = block_size // unit
    return [fine[(i + 1) * k - 1] for i in range(len(fine) // k)]


def store(
    group: int,
    hashes: Sequence[bytes],
    tokens: Sequence[int],
    block_size: int,
    kind: str = FULL,
    *,
    window: int = 0,
    parent: bytes = b"",
    lora: str = "",
    salt: str = "",
    unmatchable: bool = False,
) -> pb.KvGroupEvent:
    return pb.KvGroupEvent(
        operation=STORE,
        group_id=group,
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=block_size,
        kind=kind,
        sliding_window=window,
        lora_name=lora,
        cache_namespace=salt,
        unmatchable=unmatchable,
    )


def remove(group: int, hashes: Sequence[bytes]) -> pb.KvGroupEvent:
    return pb.KvGroupEvent(operation=REMOVE, group_id=group, block_hashes=list(hashes))


def clear() -> pb.KvGroupEvent:
    return pb.KvGroupEvent(operation=CLEAR)


def invalid() -> pb.KvGroupEvent:
    return pb.KvGroupEvent(operation=INVALID)


def batch(seq: int, *events: pb.KvGroupEvent) -> pb.KvEventBatch:
    return pb.KvEventBatch(sequence=seq, timestamp=float(seq), events=list(events))


def snapshot(
    events: Sequence[pb.KvGroupEvent],
    sequence: int | None = None,
    reason: str = "initial",
    lineage: Sequence[pb.KvGroupEvent] = (),
) -> pb.Snapshot:
    return pb.Snapshot(
        sequence=sequence or 0,
        has_sequence=sequence is not None,
        events=list(events),
        stream_id="s",
        reason=reason,
        lineage=list(lineage),
    )
