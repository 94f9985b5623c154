"""vLLM's KV-cache event wire format, every version from 0.10 to 0.33: decode and encode.

Written from the spec (docs/reference/vllm-kv-events.md §1-§2) and vLLM 0.33's
`vllm/distributed/kv_events.py`; no vLLM code is imported or copied.

Decoding (the bridge):
    decoder = BatchDecoder()              # once per stream; reuses msgspec decoders
    batch = decoder.decode(payload)       # DecodedBatch, or raises MalformedPayload
    msg = parse_live(frames)              # LiveMessage(topic, seq, payload), or MalformedFrame

Encoding (simulated engines and tests), byte-for-byte what vLLM `wire_version` sends:
    payload = encode_batch(ts, [BlockStored(...), BlockRemoved(...)], dp_rank, "0.33")
    frames = live_frames(topic, seq, payload)                    # PUB: [topic, seq, payload]
    frames = replay_reply_frames(ident, topic, seq, payload, replay_layout("0.33"))  # ROUTER
    frames = replay_end_frames(ident, layout)                    # ROUTER end marker

Wire versions: array-like tagged events up to "0.23" (shorter arrays before "0.20"), tagged
maps with a "type" key from "0.24"; the batch is always `[ts, events, dp_rank]`. A map batch
(never released, seen on one vLLM main commit) is decoded too, and can be encoded for tests.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any, Final, Literal, TypeAlias, cast

import msgspec

# ---------------------------------------------------------------------------------------------
# Records a producer builds (vLLM's field names and meaning). The encoder writes only the
# fields the chosen wire version had; everything newer is dropped.
# ---------------------------------------------------------------------------------------------

Hash: TypeAlias = int | bytes


class BlockStored(msgspec.Struct, gc=False):
    """One group's newly cached blocks (vLLM's `BlockStored`)."""

    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(msgspec.Struct, gc=False):
    """Removal of cached blocks (vLLM's `BlockRemoved`; the cache manager sends one hash)."""

    block_hashes: list[Hash]
    medium: str | None = "GPU"
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, gc=False):
    """The whole prefix cache was reset (vLLM's `AllBlocksCleared`)."""


Event: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared

# (field, first release, required). Required fields have no default in vLLM: always present in
# maps (nil allowed); optional ones default to None and are omitted from maps when None. The
# first releases are checked against frames recorded from every release (tests/conformance/
# golden); `medium` arrived in a patch release, so "0.10" means 0.10.0.
_STORED_FIELDS: Final = (
    ("block_hashes", (0, 10), True),
    ("parent_block_hash", (0, 10), True),
    ("token_ids", (0, 10), True),
    ("block_size", (0, 10), True),
    ("lora_id", (0, 10), True),
    ("medium", (0, 10, 2), True),
    ("lora_name", (0, 14), True),
    ("extra_keys", (0, 17), False),
    ("group_idx", (0, 20), False),
    ("kv_cache_spec_kind", (0, 22), False),
    ("kv_cache_spec_sliding_window", (0, 22), False),
    ("locality", (0, 26), False),
    ("ownership", (0, 29), False),
    ("session_id", (0, 30), False),
    ("lookahead_token_ids", (0, 33), False),
)
_REMOVED_FIELDS: Final = (
    ("block_hashes", (0, 10), True),
    ("medium", (0, 10, 2), True),
    ("group_idx", (0, 20), False),
    ("locality", (0, 26), False),
    ("ownership", (0, 29), False),
)

#: The wire versions checked against frames recorded from vLLM releases (any "0.N" or "0.N.P" is
#: accepted): the first minor release of each layout, and more.
KNOWN_WIRE_VERSIONS: Final = (
    "0.10",
    "0.11",
    "0.13",
    "0.14",
    "0.16",
    "0.17",
    "0.20",
    "0.22",
    "0.23",
    "0.24",
    "0.26",
    "0.28",
    "0.29",
    "0.30",
    "0.32",
    "0.33",
)
_FIRST_MAP_VERSION: Final = (0, 24)
_FIRST_TOPIC_REPLAY_VERSION: Final = (0, 26)


def parse_wire_version(wire_version: str) -> tuple[int, int]:
    """ "0.26" or "0.26.1" -> (0, 26); raises ValueError for anything else."""
    parts = wire_version.split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts[:2]):
        raise ValueError(f"wire version must look like '0.26', got {wire_version!r}")
    return int(parts[0]), int(parts[1])


def _release(wire_version: str) -> tuple[int, ...]:
    """ "0.10" -> (0, 10); "0.10.2" -> (0, 10, 2): compared with the fields' first releases."""
    parse_wire_version(wire_version)
    numbers: list[int] = []
    for part in wire_version.split("."):
        if not part.isdigit():
            break
        numbers.append(int(part))
    return tuple(numbers)


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------


def _field_specs(
    table: Sequence[tuple[str, tuple[int, ...], bool]], version: tuple[int, ...], as_map: bool
) -> list[tuple[str, Any] | tuple[str, Any, Any]]:
    specs: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for name, since, required in table:
        if version < since:
            continue
        # In arrays every field is written, so the default only matters for maps.
        specs.append((name, Any) if required or not as_map else (name, Any, None))
    return specs


class WireEncoder:
    """Encodes batches exactly as vLLM `wire_version` does. Build once, reuse."""

    def __init__(self, wire_version: str, *, batch_as_map: bool = False) -> None:
        version = _release(wire_version)
        self.wire_version = wire_version
        self.events_as_maps = version >= _FIRST_MAP_VERSION
        options: dict[str, Any] = {"gc": False}
        if self.events_as_maps:
            options.update(tag_field="type", omit_defaults=True)
        else:
            options.update(array_like=True)
        stored_specs = _field_specs(_STORED_FIELDS, version, self.events_as_maps)
        removed_specs = _field_specs(_REMOVED_FIELDS, version, self.events_as_maps)
        self._stored_names = [spec[0] for spec in stored_specs]
        self._removed_names = [spec[0] for spec in removed_specs]
        self._stored_cls = msgspec.defstruct(
            "BlockStored", stored_specs, tag="BlockStored", **options
        )
        self._removed_cls = msgspec.defstruct(
            "BlockRemoved", removed_specs, tag="BlockRemoved", **options
        )
        self._cleared = msgspec.defstruct(
            "AllBlocksCleared", [], tag="AllBlocksCleared", **options
        )()
        # vLLM's batch: array_like in every release; a map only on one unreleased commit.
        self._batch_cls = msgspec.defstruct(
            "KVEventBatch",
            [("ts", float), ("events", list[Any]), ("data_parallel_rank", Any, None)],
            array_like=not batch_as_map,
            gc=False,
        )
        self._encoder = msgspec.msgpack.Encoder()

    def _wire_event(self, event: Event) -> Any:
        if isinstance(event, BlockStored):
            return self._stored_cls(*[getattr(event, name) for name in self._stored_names])
        if isinstance(event, BlockRemoved):
            return self._removed_cls(*[getattr(event, name) for name in self._removed_names])
        if isinstance(event, AllBlocksCleared):
            return self._cleared
        raise TypeError(f"not a vLLM event record: {type(event).__name__}")

    def encode_batch(self, ts: float, events: Sequence[Event], dp_rank: int | None) -> bytes:
        """The msgpack payload of one `KVEventBatch` (the third frame of a live message)."""
        wire_events = [self._wire_event(event) for event in events]
        return self._encoder.encode(self._batch_cls(float(ts), wire_events, dp_rank))


@functools.lru_cache(maxsize=64)
def wire_encoder(wire_version: str, batch_as_map: bool = False) -> WireEncoder:
    """A shared, immutable `WireEncoder` for that version (built once per version)."""
    return WireEncoder(wire_version, batch_as_map=batch_as_map)


def encode_batch(
    ts: float,
    events: Sequence[Event],
    dp_rank: int | None,
    wire_version: str,
    *,
    batch_as_map: bool = False,
) -> bytes:
    """Encode one batch exactly as vLLM `wire_version` ("0.23", "0.26", "0.33", ...) would.

    `dp_rank` is written as given (vLLM's publisher fills in its own rank when it is None).
    Fields the version did not have are dropped; in maps, optional fields that are None are
    omitted, required ones are written as nil.
    """
    return wire_encoder(wire_version, batch_as_map).encode_batch(ts, events, dp_rank)


# ---------------------------------------------------------------------------------------------
# Decoding: one set of msgspec decoders, built once per stream. Hash fields are typed Any so
# that a bad hash (bool, float, empty) becomes an INVALID event in the converter instead of
# failing the whole batch; every other wrong type fails the batch (malformed).
# ---------------------------------------------------------------------------------------------


class DecodedStored(msgspec.Struct, gc=False):
    """A decoded `BlockStored`, whichever layout it came in. Fields absent in older versions
    are None."""

    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[Any] | None = None


class DecodedRemoved(msgspec.Struct, gc=False):
    """A decoded `BlockRemoved`."""

    block_hashes: list[Any]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class DecodedCleared(msgspec.Struct, gc=False):
    """A decoded `AllBlocksCleared`."""


DecodedEvent: TypeAlias = DecodedStored | DecodedRemoved | DecodedCleared


class DecodedBatch(msgspec.Struct, gc=False):
    """A decoded `KVEventBatch`: engine timestamp, events in order, the engine's DP rank."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


# Concrete layouts: a batch is an array (every release) or a map (one unreleased commit), its
# events tagged arrays (<= 0.23) or tagged maps (0.24+). Array events and map events cannot
# share one msgspec union, so each (batch layout, event layout) pair gets its own decoder; a
# stream never mixes them, so the decoder that worked last is tried first. Each comes in a
# strict form, which rejects unknown map keys and extra array elements, and a lenient one,
# which ignores them: strict first, so that newer producers are noticed (and counted), not
# failed.
_EVENT_TAGS: Final = (
    (DecodedStored, "BlockStored"),
    (DecodedRemoved, "BlockRemoved"),
    (DecodedCleared, "AllBlocksCleared"),
)


def _batch_type(batch_as_map: bool, events_as_maps: bool, strict: bool) -> type[DecodedBatch]:
    """The msgspec type that decodes batches of one layout into `DecodedBatch`es."""
    layout = ("Map" if events_as_maps else "Array") + ("Strict" if strict else "")
    event_options: dict[str, Any] = (
        {"tag_field": "type"} if events_as_maps else {"array_like": True}
    )
    events = [
        msgspec.defstruct(
            f"_{tag}{layout}",
            [],
            bases=(base,),
            tag=tag,
            forbid_unknown_fields=strict,
            gc=False,
            **event_options,
        )
        for base, tag in _EVENT_TAGS
    ]
    batch = msgspec.defstruct(
        f"_Batch{'Map' if batch_as_map else 'Array'}Of{layout}",
        [("events", list[functools.reduce(operator.or_, events)])],  # type: ignore[misc]
        bases=(DecodedBatch,),
        array_like=not batch_as_map,
        forbid_unknown_fields=strict,
        gc=False,
    )
    return cast(type[DecodedBatch], batch)


# (strict, lenient) per (batch as map, events as maps), most common first: 0.24+ maps, then
# <= 0.23 arrays.
_LAYOUTS: Final = tuple(
    (
        _batch_type(batch_as_map, events_as_maps, True),
        _batch_type(batch_as_map, events_as_maps, False),
    )
    for batch_as_map, events_as_maps in ((False, True), (False, False), (True, True), (True, False))
)

_KNOWN_STORED = frozenset(name for name, _, _ in _STORED_FIELDS) | {"type"}
_KNOWN_REMOVED = frozenset(name for name, _, _ in _REMOVED_FIELDS) | {"type"}
_KNOWN_BATCH = frozenset({"ts", "events", "data_parallel_rank"})
_MAX_UNKNOWN_NAMES: Final = 32
_MAX_ANALYSED: Final = 16


# msgspec reports invalid UTF-8 in strings and keys as UnicodeDecodeError.
_DECODE_ERRORS: Final = (msgspec.MsgspecError, UnicodeDecodeError)


class MalformedPayload(ValueError):
    """The payload is not a KVEventBatch of any known wire version."""


class BatchDecoder:
    """Decodes `KVEventBatch` payloads of every wire version. Build once per stream.

    Unknown extra fields (map keys, trailing array elements) are ignored and counted in
    `unknown_field_batches`; their names (bounded) are collected in `unknown_field_names`.
    """

    def __init__(self) -> None:
        self._decoders = [
            (msgspec.msgpack.Decoder(strict), msgspec.msgpack.Decoder(lenient))
            for strict, lenient in _LAYOUTS
        ]
        self._last = 0
        self._analysed = 0
        self.unknown_field_batches = 0
        self.unknown_field_names: set[str] = set()

    def decode(self, payload: bytes) -> DecodedBatch:
        """The decoded batch; raises `MalformedPayload` if no wire version fits."""
        strict, lenient = self._decoders[self._last]
        try:
            result: DecodedBatch = strict.decode(payload)
            return result
        except _DECODE_ERRORS:
            pass
        return self._decode_slow(payload, lenient)

    def _decode_slow(self, payload: bytes, last_lenient: Any) -> DecodedBatch:
        # Same layout with unknown fields (a newer producer) is the common reason to be here.
        try:
            result: DecodedBatch = last_lenient.decode(payload)
        except _DECODE_ERRORS:
            pass
        else:
            self._note_unknown(payload)
            return result
        error: Exception | None = None
        for index, (strict, lenient) in enumerate(self._decoders):
            if index == self._last:
                continue
            try:
                result = strict.decode(payload)
            except _DECODE_ERRORS:
                pass
            else:
                self._last = index
                return result
            try:
                result = lenient.decode(payload)
            except _DECODE_ERRORS as exc:
                error = error or exc
            else:
                self._last = index
                self._note_unknown(payload)
                return result
        try:
            # The first layout's error is the most telling for a modern producer.
            self._decoders[0][1].decode(payload)
        except _DECODE_ERRORS as exc:
            error = exc
        raise MalformedPayload(f"not a KVEventBatch of any known wire version: {error}")

    def _note_unknown(self, payload: bytes) -> None:
        self.unknown_field_batches += 1
        if self._analysed >= _MAX_ANALYSED:
            return
        self._analysed += 1
        try:
            raw = msgspec.msgpack.decode(payload)
        except _DECODE_ERRORS:
            return
        for name in _unknown_field_names(raw):
            if len(self.unknown_field_names) >= _MAX_UNKNOWN_NAMES:
                break
            self.unknown_field_names.add(name)


def _unknown_field_names(raw: Any) -> list[str]:
    """Names of fields this module does not know, in a generically decoded batch."""
    names: list[str] = []
    if isinstance(raw, dict):
        names += [f"batch.{key}" for key in raw if key not in _KNOWN_BATCH]
        events = raw.get("events")
    elif isinstance(raw, list):
        if len(raw) > 3:
            names.append(f"batch[{len(raw) - 1}]")
        events = raw[1] if len(raw) > 1 else None
    else:
        return names
    for event in events if isinstance(events, list) else ():
        if isinstance(event, dict):
            known = _KNOWN_STORED if event.get("type") == "BlockStored" else _KNOWN_REMOVED
            names += [f"{event.get('type')}.{key}" for key in event if key not in known]
        elif isinstance(event, list) and event:
            limit = {"BlockStored": len(_STORED_FIELDS), "BlockRemoved": len(_REMOVED_FIELDS)}
            width = limit.get(event[0], 0) + 1
            if len(event) > width:
                names.append(f"{event[0]}[{width}:]")
    return sorted(set(names))


# ---------------------------------------------------------------------------------------------
# Frames: live messages and the replay protocol
# ---------------------------------------------------------------------------------------------

#: The replay end marker's seq frame: -1 as 8 bytes two's complement.
END_SEQ: Final = b"\xff" * 8

#: How replay replies look to a DEALER: "pre-0.26" = [b"", seq, payload],
#: "0.26" = [b"", topic, seq, payload]. End markers: [b"", END, b""] / [b"", b"", END, b""].
ReplayLayout: TypeAlias = Literal["pre-0.26", "0.26"]


class MalformedFrame(ValueError):
    """A multipart message that does not have the expected frames."""


class LiveMessage(msgspec.Struct, gc=False):
    """One live message from the PUB socket."""

    topic: bytes
    seq: int
    payload: bytes


class ReplayedMessage(msgspec.Struct, gc=False):
    """One replayed batch as received on a DEALER (topic is None in the pre-0.26 layout)."""

    seq: int
    payload: bytes
    topic: bytes | None


def seq_frame(seq: int) -> bytes:
    """A sequence number as vLLM sends it: 8 bytes big-endian unsigned."""
    return seq.to_bytes(8, "big")


def parse_seq(frame: bytes) -> int:
    """The unsigned sequence number in an 8-byte frame; MalformedFrame otherwise."""
    if len(frame) != 8:
        raise MalformedFrame(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def replay_layout(wire_version: str) -> ReplayLayout:
    """The replay reply layout vLLM `wire_version` uses."""
    if parse_wire_version(wire_version) >= _FIRST_TOPIC_REPLAY_VERSION:
        return "0.26"
    return "pre-0.26"


def _topic_bytes(topic: str | bytes) -> bytes:
    return topic.encode("utf-8") if isinstance(topic, str) else topic


def live_frames(topic: str | bytes, seq: int, payload: bytes) -> list[bytes]:
    """The 3 frames vLLM's PUB socket sends for one batch: [topic, seq, payload]."""
    return [_topic_bytes(topic), seq_frame(seq), payload]


def parse_live(frames: Sequence[bytes]) -> LiveMessage:
    """A live message from its frames; MalformedFrame if it is not [topic, seq8, payload]."""
    if len(frames) != 3:
        raise MalformedFrame(f"live message must have 3 frames, got {len(frames)}")
    return LiveMessage(bytes(frames[0]), parse_seq(frames[1]), bytes(frames[2]))


def replay_request_frames(start_seq: int) -> list[bytes]:
    """What a DEALER sends to ask for every buffered batch with seq >= start_seq."""
    return [b"", seq_frame(start_seq)]


def parse_replay_request(frames: Sequence[bytes]) -> tuple[bytes, int]:
    """(identity, start_seq) from a request as a ROUTER receives it: [identity, b"", seq8]."""
    if len(frames) != 3 or frames[1] != b"":
        raise MalformedFrame(f"replay request must be [identity, b'', seq], got {len(frames)}")
    return bytes(frames[0]), parse_seq(frames[2])


def replay_reply_frames(
    identity: bytes, topic: str | bytes, seq: int, payload: bytes, layout: ReplayLayout
) -> list[bytes]:
    """What vLLM's ROUTER sends for one replayed batch (identity first, as ROUTER needs)."""
    if layout == "0.26":
        return [identity, b"", _topic_bytes(topic), seq_frame(seq), payload]
    return [identity, b"", seq_frame(seq), payload]


def replay_end_frames(identity: bytes, layout: ReplayLayout) -> list[bytes]:
    """What vLLM's ROUTER sends after the last replayed batch."""
    if layout == "0.26":
        return [identity, b"", b"", END_SEQ, b""]
    return [identity, b"", END_SEQ, b""]


def parse_replay_reply(frames: Sequence[bytes]) -> ReplayedMessage | None:
    """A replayed batch as a DEALER receives it, in either layout; None for the end marker.

    Raises MalformedFrame for anything else.
    """
    if len(frames) == 3:
        topic: bytes | None = None
        seq_bytes, payload = frames[1], frames[2]
    elif len(frames) == 4:
        topic, seq_bytes, payload = bytes(frames[1]), frames[2], frames[3]
    else:
        raise MalformedFrame(f"replay reply must have 3 or 4 frames, got {len(frames)}")
    if frames[0] != b"":
        raise MalformedFrame("replay reply must start with an empty delimiter frame")
    if seq_bytes == END_SEQ:
        return None
    return ReplayedMessage(parse_seq(seq_bytes), bytes(payload), topic)
