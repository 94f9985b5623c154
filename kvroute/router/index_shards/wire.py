"""The messages between a router process and an index shard, and their framing.

Each message is one msgpack-encoded msgspec Struct (tagged by its class), sent as a 4-byte
big-endian length and the bytes. Every size an outside peer controls is bounded: a frame
longer than `MAX_FRAME_BYTES`, or a message whose lists or names exceed their bounds, fails
to decode and the connection is closed (the peer reconnects and resends what it follows).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

MAX_FRAME_BYTES = 16 * 1024 * 1024
MAX_KEYS = 1 << 20  # a 16M-token prompt at hash_unit 16
MAX_WORKERS = 65_536
MAX_SERIES = 8 * MAX_WORKERS  # event series a status answer carries (a few per worker)
HEADER = struct.Struct(">I")
_MASK64 = (1 << 64) - 1

Name = Annotated[str, Meta(max_length=512)]
Text = Annotated[str, Meta(max_length=4096)]
# Content keys travel as their low 64 bits (the chained hash); the high bits are the key's
# position in units, consecutive from `start` in a prompt's keys (kvroute.indexer.keys).
Keys = Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=MAX_KEYS)]
Start = Annotated[int, Meta(ge=1, le=1 << 40)]
Names = Annotated[list[Name], Meta(max_length=MAX_WORKERS)]
Count = Annotated[int, Meta(ge=0)]
Blob = Annotated[bytes, Meta(max_length=MAX_FRAME_BYTES)]


class WorkerRef(Struct, frozen=True):
    """What a shard needs to follow a worker's events (a `WorkerSpec`'s event fields)."""

    name: Name
    bridge: Name | None = None
    zmq: Name | None = None
    replay: Name | None = None
    topic: Name = ""
    dp_rank: Count = 0


# -- router -> shard: control connection (asyncio) --------------------------------------
class Follow(Struct, tag=True):
    """This connection follows these workers too (added, or updated when their fields change)."""

    workers: Annotated[list[WorkerRef], Meta(max_length=MAX_WORKERS)]


class Unfollow(Struct, tag=True):
    names: Names


class Resync(Struct, tag=True):
    name: Name


class StatusAsk(Struct, tag=True):
    id: int


# -- router -> shard: query connection (blocking, on the router's event loop) -------------
class Query(Struct, tag=True):
    """`op` is score, reach, explain or tiers; `gpu` (tiers only): the GPU reuse of the
    shard's workers that the tier lookup starts from."""

    id: int
    op: Annotated[str, Meta(max_length=16)]
    keys: Keys
    n_tokens: Count
    gpu: dict[Name, int | None] | None = None
    start: Start = 1


class Expect(Struct, tag=True):
    worker: Name
    keys: Keys
    n_tokens: Count
    ttl_s: float
    junction: Count = 0
    start: Start = 1


class Apply(Struct, tag=True):
    """An event batch (`snapshot` False) or snapshot, serialized protobuf, for one worker."""

    worker: Name
    data: Blob
    snapshot: bool = False


class Invalidate(Struct, tag=True):
    worker: Name


class RemoveWorker(Struct, tag=True):
    worker: Name


class Alignment(Struct, tag=True):
    worker: Name
    alignment: int | None


ToShard = (
    Follow
    | Unfollow
    | Resync
    | StatusAsk
    | Query
    | Expect
    | Apply
    | Invalidate
    | RemoveWorker
    | Alignment
)


# -- shard -> router ----------------------------------------------------------------------
class Group(Struct, array_like=True):
    group_id: int
    kind: Name
    block_size: int
    sliding_window: int
    accepted_tokens: int | None


class Explained(Struct, array_like=True):
    reusable_tokens: int | None
    groups: list[Group]
    alignment: int
    reason: Text
    expected_tokens: int


class Answer(Struct, tag=True):
    """A query's answer for the shard's workers; `down`: its followed workers whose stream
    is not live; `tiered`: some worker of the shard has lower-tier entries."""

    id: int
    scores: dict[Name, int | None] = {}
    coverage: dict[Name, int] = {}
    explained: dict[Name, Explained] = {}
    tiers: dict[Name, tuple[int, int]] = {}
    down: Names = []
    tiered: bool = False


class WorkerStatus(Struct, array_like=True):
    """One followed (or fed) worker: its stream (times as ages in seconds) and index stats."""

    name: Name
    state: Name
    since_age_s: float
    message_age_s: float | None
    last_sequence: int | None
    stream_id: Text
    snapshots: int
    batches: int
    reconnects: int
    last_error: Text
    valid: bool | None  # None: not in the index (yet)
    index_sequence: int | None
    blocks_per_group: dict[int, int]
    entries: int
    pending: int
    evicted: int
    resets: int


class Series(Struct, array_like=True):
    """One series of the shard's `kvroute_event_*` families since it started: a counter's
    value, or a histogram's count per bucket (+Inf last) then its sum."""

    family: Name
    labels: Annotated[list[Name], Meta(max_length=8)]
    values: Annotated[list[float], Meta(max_length=64)]


class StatusAnswer(Struct, tag=True):
    id: int
    shard: int
    generation: int
    workers: list[WorkerStatus]
    series: Annotated[list[Series], Meta(max_length=MAX_SERIES)] = []


FromShard = Answer | StatusAnswer

_to_shard = msgspec.msgpack.Decoder(ToShard)  # type: ignore[var-annotated]
_from_shard = msgspec.msgpack.Decoder(FromShard)  # type: ignore[var-annotated]
_encoder = msgspec.msgpack.Encoder()


def split_keys(keys: Sequence[int]) -> tuple[list[int], int]:
    """A prompt's keys as (low 64 bits each, position of the first); ValueError if their
    positions are not consecutive (not one prompt's keys)."""
    if not keys:
        return [], 1
    start = keys[0] >> 64
    if start < 1 or keys[-1] >> 64 != start + len(keys) - 1:
        raise ValueError("keys are not one prompt's consecutive content keys")
    return [k & _MASK64 for k in keys], start


def join_keys(low: list[int], start: int) -> list[int]:
    """The keys `split_keys` split."""
    return [(start + i) << 64 | k for i, k in enumerate(low)]


class WireError(ValueError):
    """Bytes that are not a valid message (or a frame too long): the connection is closed."""


def frame(message: Struct) -> bytes:
    """The message as one frame: length, then msgpack."""
    body = _encoder.encode(message)
    if len(body) > MAX_FRAME_BYTES:
        raise WireError(f"message of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    """The body length a frame header announces; WireError beyond the bound."""
    (n,) = HEADER.unpack(header)
    if n > MAX_FRAME_BYTES:
        raise WireError(f"frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
    return int(n)


def decode_to_shard(body: bytes | memoryview) -> ToShard:
    try:
        return _to_shard.decode(body)  # type: ignore[no-any-return]
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"bad message to the shard: {exc}") from None


def decode_from_shard(body: bytes | memoryview) -> FromShard:
    try:
        return _from_shard.decode(body)  # type: ignore[no-any-return]
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"bad message from the shard: {exc}") from None


class FrameReader:
    """Splits a byte stream into frame bodies; bounded: at most one frame is buffered."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The complete frame bodies `data` finishes; WireError on an oversized frame."""
        self._buf += data
        out: list[bytes] = []
        buf = self._buf
        pos = 0
        while len(buf) - pos >= HEADER.size:
            n = frame_length(bytes(buf[pos : pos + HEADER.size]))
            end = pos + HEADER.size + n
            if len(buf) < end:
                break
            out.append(bytes(buf[pos + HEADER.size : end]))
            pos = end
        if pos:
            del buf[:pos]
        return out
