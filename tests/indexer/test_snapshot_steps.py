"""`FleetIndex.apply_snapshot_steps`: the same view as `apply_snapshot`, built in bounded
steps while the old view keeps answering; a later change wins; nothing is left behind."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.indexer import FleetIndex, Namespace
from kvroute.proto import events_pb2 as pb
from tests.indexer.events import batch, snapshot, store
from tests.indexer.streams import Request, WorkerStream, make_stream

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
T = list(range(100, 100 + 64))  # 4 blocks of 16


def scores(fleet: FleetIndex, probes: list[Request]) -> list[object]:
    out: list[object] = []
    for p in probes:
        ns = Namespace(*p.ns)
        out.append(fleet.score(p.tokens, ns))
        out.append({k: dataclasses.astuple(v) for k, v in fleet.explain(p.tokens, ns).items()})
    return out


def stats(fleet: FleetIndex) -> dict[str, object]:
    return {w: fleet.stats(w) for w in fleet.workers()}


def feed(fleet: FleetIndex, name: str, kind: str, arg: object) -> None:
    if kind == "batch":
        assert isinstance(arg, pb.KvEventBatch)
        fleet.apply(name, arg)
    elif kind == "snapshot":
        assert isinstance(arg, pb.Snapshot)
        fleet.apply_snapshot(name, arg)
    elif kind == "invalidate":
        fleet.invalidate(name)
    else:
        assert isinstance(arg, int) or arg is None
        fleet.set_alignment(name, arg)


def empty(fleet: FleetIndex) -> bool:
    return all(not d for d in fleet._inv.slots) and fleet._inv.shared_bitsets() == 0


@SETTINGS
@given(seed=st.integers(0, 2**32), n_workers=st.integers(1, 3), step=st.integers(1, 9))
def test_steps_end_where_apply_snapshot_ends_and_the_old_view_answers_meanwhile(
    seed: int, n_workers: int, step: int
) -> None:
    rng = random.Random(seed)
    streams: dict[str, WorkerStream] = {f"w{i}": make_stream(rng) for i in range(n_workers)}
    at_once, stepped = FleetIndex(), FleetIndex()
    for _ in range(40):
        name = rng.choice(list(streams))
        for kind, arg in streams[name].next_actions():
            if kind != "snapshot":
                feed(at_once, name, kind, arg)
                feed(stepped, name, kind, arg)
                continue
            assert isinstance(arg, pb.Snapshot)
            probes = [p for s in streams.values() for p in s.probes(2)]
            before = scores(stepped, probes)
            feed(at_once, name, kind, arg)
            after = scores(at_once, probes)
            swapped = False
            for i, _ in enumerate(stepped.apply_snapshot_steps(name, arg, blocks_per_step=step)):
                if i % 2 == 0:  # the old view answers until the swap, then the new one
                    current = scores(stepped, probes)
                    swapped = swapped or (current == after and current != before)
                    assert current == (after if swapped else before)
        probes = [p for s in streams.values() for p in s.probes(3)]
        assert scores(stepped, probes) == scores(at_once, probes)
        assert stats(stepped) == stats(at_once)
    for name in list(stepped.workers()):
        stepped.remove_worker(name)
    assert empty(stepped)
    assert len(stepped._names) <= n_workers + 1  # shadow indexes are recycled


def _two_views() -> tuple[FleetIndex, pb.Snapshot]:
    fleet = FleetIndex()
    fleet.apply_snapshot("w0", snapshot([store(0, [b"a", b"b"], T[:32], 16, "full_attention")], 1))
    events = [store(0, [b"c%d" % i], T[16 * i : 16 * i + 16], 16, "full_attention",
                    parent=b"c%d" % (i - 1) if i else b"") for i in range(4)]  # fmt: skip
    return fleet, snapshot(events, 7)


def test_old_view_serves_until_the_swap_then_the_new_one() -> None:
    fleet, snap = _two_views()
    steps = fleet.apply_snapshot_steps("w0", snap, blocks_per_step=1)
    seen = []
    for _ in steps:
        seen.append(fleet.score(T)["w0"])
    assert seen[0] == 32 and seen[-1] == 48  # old view (2 blocks), then the new (3 of 4 reused)
    assert seen == sorted(seen) and set(seen) == {32, 48}
    assert fleet.stats("w0").last_sequence == 7 and fleet.stats("w0").snapshots == 2
    fleet.remove_worker("w0")
    assert empty(fleet)


def test_a_later_change_wins_and_the_built_view_is_withdrawn() -> None:
    fleet, snap = _two_views()
    steps = fleet.apply_snapshot_steps("w0", snap, blocks_per_step=1)
    next(steps)
    fleet.apply("w0", batch(2, store(0, [b"x"], T[32:48], 16, "full_attention", parent=b"b")))
    for _ in steps:
        pass
    assert fleet.score(T)["w0"] == 48  # the batch extended the old view; the snapshot dropped
    assert fleet.stats("w0").last_sequence == 2
    fleet.remove_worker("w0")
    assert empty(fleet)


@pytest.mark.parametrize("after", [1, 3, 6])
def test_closing_early_or_removing_the_worker_leaves_nothing_behind(after: int) -> None:
    fleet, snap = _two_views()
    steps = fleet.apply_snapshot_steps("w0", snap, blocks_per_step=1)
    for _ in range(after):
        next(steps, None)
    steps.close()
    fleet.remove_worker("w0")
    assert empty(fleet)
    fleet, snap = _two_views()
    steps = fleet.apply_snapshot_steps("w0", snap, blocks_per_step=1)
    next(steps)
    fleet.remove_worker("w0")
    for _ in steps:
        pass
    assert empty(fleet) and fleet.workers() == []


def test_expectations_follow_the_swap() -> None:
    fleet, snap = _two_views()
    fleet.expect("w0", T + [1] * 40, None, expires_at=100.0)
    before = fleet.score(T + [1] * 40)["w0"]
    for _ in fleet.apply_snapshot_steps("w0", snap, blocks_per_step=1):
        pass
    assert fleet.score(T + [1] * 40)["w0"] == before == 96
    fleet.expire(100.0)
    assert fleet.score(T + [1] * 40)["w0"] == 64  # the new view's own 4 blocks
