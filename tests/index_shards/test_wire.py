"""The shard wire format: round trips, bounds, and hostile bytes (never anything but a
`WireError` out of the decoders, and never an unbounded buffer)."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.index_shards import wire
from kvroute.router.index_shards.assign import shard_of

names = st.text(min_size=1, max_size=20)
keys = st.lists(st.integers(0, 2**64 - 1), max_size=50)
scores = st.dictionaries(names, st.none() | st.integers(0, 1 << 20), max_size=8)

to_shard = st.one_of(
    st.builds(
        wire.Query,
        st.integers(0, 2**62),
        st.sampled_from(["score", "reach"]),
        keys,
        st.integers(0, 1 << 20),
        st.none() | scores,
    ),
    st.builds(wire.Expect, names, keys, st.integers(0, 1 << 20), st.floats(0, 100)),
    st.builds(
        wire.Follow, st.lists(st.builds(wire.WorkerRef, names, st.none() | names), max_size=4)
    ),
    st.builds(wire.Unfollow, st.lists(names, max_size=4)),
    st.builds(wire.Apply, names, st.binary(max_size=64), st.booleans()),
    st.builds(wire.Alignment, names, st.none() | st.integers(0, 4096)),
)


@settings(max_examples=200, deadline=None)
@given(to_shard)
def test_messages_to_a_shard_round_trip(message: wire.ToShard) -> None:
    (body,) = wire.FrameReader().feed(wire.frame(message))
    assert wire.decode_to_shard(body) == message


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**62), scores, st.lists(names, max_size=4), st.booleans())
def test_answers_round_trip(qid: int, s: dict[str, int | None], down: list[str], t: bool) -> None:
    answer = wire.Answer(qid, scores=s, down=down, tiered=t)
    (body,) = wire.FrameReader().feed(wire.frame(answer))
    assert wire.decode_from_shard(body) == answer


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=512))
def test_hostile_bytes_only_ever_raise_wire_error(data: bytes) -> None:
    for decode in (wire.decode_to_shard, wire.decode_from_shard):
        with contextlib.suppress(wire.WireError):
            decode(data)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["type", "id", "op", "keys", "n_tokens", "gpu", "worker", "data", "x"]),
        st.one_of(
            st.sampled_from(["Query", "Expect", "Apply", "Follow", "Nope"]),
            st.integers(-(2**63), 2**64 - 1),
            st.floats(allow_nan=True),
            st.text(max_size=8),
            st.lists(st.integers(-(2**63), 2**64 - 1), max_size=4),
            st.none(),
        ),
        max_size=8,
    )
)
def test_well_formed_msgpack_of_the_wrong_shape_is_refused(obj: dict[str, object]) -> None:
    """msgpack that decodes, but not to a valid message: wrong tags, types, negative sizes."""
    body = msgspec.msgpack.encode(obj)
    try:
        message = wire.decode_to_shard(body)
    except wire.WireError:
        return
    assert isinstance(message, wire.ToShard.__args__)  # type: ignore[attr-defined]


def test_bounds_are_enforced() -> None:
    with pytest.raises(wire.WireError):
        wire.FrameReader().feed(wire.HEADER.pack(wire.MAX_FRAME_BYTES + 1))
    too_many = wire.Query(1, "score", [0] * (wire.MAX_KEYS + 1), 16)
    with pytest.raises(wire.WireError):
        wire.decode_to_shard(msgspec.msgpack.encode(too_many))
    with pytest.raises(wire.WireError):
        wire.decode_to_shard(msgspec.msgpack.encode(wire.Expect("w", [], -1, 1.0)))
    long_name = wire.Invalidate("n" * 513)
    with pytest.raises(wire.WireError):
        wire.decode_to_shard(msgspec.msgpack.encode(long_name))


def test_a_reader_holds_a_partial_frame_until_it_is_complete() -> None:
    frames = wire.frame(wire.Invalidate("a")) + wire.frame(wire.Invalidate("b"))
    reader = wire.FrameReader()
    got = []
    for i in range(len(frames)):
        got += reader.feed(frames[i : i + 1])
    assert [wire.decode_to_shard(b) for b in got] == [wire.Invalidate("a"), wire.Invalidate("b")]


def test_the_assignment_is_stable_and_spreads_workers() -> None:
    counts = [0, 0, 0, 0]
    for i in range(4000):
        counts[shard_of(f"worker-{i}", 4)] += 1
    assert min(counts) > 850  # ~1000 each
    # fixed across processes and versions: Python's salted hash() would move workers
    assert [shard_of(n, 4) for n in ("w0", "w1", "w2", "w3")] == [3, 0, 2, 1]
