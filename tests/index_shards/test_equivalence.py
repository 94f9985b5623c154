"""The shard-backed view answers exactly as the in-process index: the same event batches
(dense and hybrid layouts, lower tiers, expectations) go to an in-process `FleetIndexView`
and, through `ShardedIndexView`, to K real shard processes; every query's answer is compared
byte for byte (canonical JSON)."""

from __future__ import annotations

import copy
import dataclasses
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from bench.index_bench import LAYOUTS, SYSTEM, Engine, tokens
from kvroute.proto import events_pb2 as pb
from kvroute.router.index_shards import wire
from kvroute.router.index_shards.client import ShardedIndexView
from kvroute.router.index_shards.server import ShardSettings
from kvroute.router.index_shards.supervisor import ShardSupervisor
from kvroute.router.routing.fleet_index_view import FleetIndexView

WORKERS = [f"w{i}" for i in range(10)]


@pytest.fixture(scope="module")
def shards() -> Iterator[ShardSupervisor]:
    sup = ShardSupervisor(3, ShardSettings())
    sup.start()
    yield sup
    sup.stop()


def wait_for(sup: ShardSupervisor, timeout_s: float = 30.0) -> list[str]:
    """The shards' socket paths, once every one accepts connections."""
    paths = [sup.socket(i) for i in range(sup.shards)]
    deadline = time.monotonic() + timeout_s
    for path in paths:
        while True:
            with socket.socket(socket.AF_UNIX) as s:
                try:
                    s.connect(path)
                    break
                except OSError:
                    assert time.monotonic() < deadline, f"{path} never accepted"
                    time.sleep(0.05)
    return paths


def canonical(obj: Any) -> bytes:
    def plain(o: Any) -> Any:
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            return {f.name: plain(getattr(o, f.name)) for f in dataclasses.fields(o)}
        if isinstance(o, dict):
            return {str(k): plain(v) for k, v in o.items()}
        if isinstance(o, list | tuple):
            return [plain(v) for v in o]
        return o

    return json.dumps(plain(obj), sort_keys=True, separators=(",", ":")).encode()


def to_cpu_tier(batch: pb.KvEventBatch, engine: Engine) -> pb.KvEventBatch:
    """The same stores, as a CPU tier's (an offloading connector's) events only, in the
    sequence of `engine`'s batches."""
    out = pb.KvEventBatch(sequence=engine.seq)
    engine.seq += 1
    for e in batch.events:
        t = copy.deepcopy(e)
        t.tier = pb.Tier.CPU
        out.tier_events.append(t)
    return out


def feed(views: list[Any], layout: str, seed: int) -> list[list[int]]:
    """Build a fleet's content into every view; returns the prompts to ask about."""
    system = tokens(SYSTEM, seed)
    engines = {w: Engine(LAYOUTS[layout]) for w in WORKERS}
    prompts = []
    for i, w in enumerate(WORKERS):
        batches = engines[w].prompt(system)
        for k in range(2):
            convo = system + tokens(3000 + 700 * k, seed + 100 * i + k)
            batches += engines[w].prompt(convo, start=SYSTEM)
            prompts.append(convo + tokens(500, seed + 9000 + i))  # a follow-up turn
        if layout == "full" and i % 3 == 0:  # a deeper turn offloaded to CPU only
            deep = convo + tokens(4096, seed + 5000 + i)
            batches += [to_cpu_tier(b, engines[w]) for b in Engine(LAYOUTS[layout]).prompt(deep)]
            prompts.append(deep + tokens(64, 1))
        for b in batches:
            for v in views:
                v.apply(w, b)
    prompts.append(system + tokens(1000, seed + 4242))  # cold: the system prompt only
    prompts.append(tokens(300, seed + 777))  # nothing anywhere
    return prompts


@pytest.mark.parametrize("layout", ["full", "hybrid"])
def test_every_answer_is_byte_identical(shards: ShardSupervisor, layout: str) -> None:
    local = FleetIndexView()
    remote = ShardedIndexView(wait_for(shards), deadline_s=10.0)
    seed = 11 if layout == "full" else 23
    for w in WORKERS:  # a fresh index for this test in the shared shards
        remote.remove_worker(w)
    prompts = feed([local, remote], layout, seed)
    for i, p in enumerate(prompts[:4]):  # expectations on a few workers
        for v in (local, remote):
            v.expect(WORKERS[(i * 3) % len(WORKERS)], p, "", "", 600.0, junction=i * 16)
    remote.set_alignment(WORKERS[1], 64)
    local.set_alignment(WORKERS[1], 64)
    compared = 0
    for p in prompts:
        for lora, salt in (("", ""), ("adapter", "tenant-a")):
            want_scores, want_cov = local.reach(p, lora, salt)
            got_scores, got_cov = remote.reach(p, lora, salt)
            assert canonical(got_scores) == canonical(want_scores)
            assert canonical(got_cov) == canonical(want_cov)
            assert canonical(remote.score(p, lora, salt)) == canonical(local.score(p, lora, salt))
            assert canonical(remote.explain(p, lora, salt)) == canonical(
                local.explain(p, lora, salt)
            )
            want_tiers = local.tiers(p, want_scores, lora, salt)
            assert canonical(remote.tiers(p, got_scores, lora, salt)) == canonical(want_tiers)
            compared += 1
    assert compared == 2 * len(prompts)
    # the fleet is not trivial: hits, misses and lower-tier gains were all compared
    best = [max((v or 0) for v in local.score(p).values()) for p in prompts]
    assert max(best) > 3000 and min(best) == 0
    if layout == "full":
        assert any(local.tiers(p, local.score(p)) for p in prompts)
    assert not any(remote.missed.labels(str(i))._value.get() for i in range(3))
    remote.close()


NEGATIVE_KEY = {"type": "Query", "id": 1, "op": "score", "keys": [-1], "n_tokens": 1}


def framed(obj: object) -> bytes:
    body = msgspec.msgpack.encode(obj)
    return wire.HEADER.pack(len(body)) + body


@pytest.mark.parametrize(
    "frame",
    [
        wire.HEADER.pack(5) + b"\xc1\xc1\xc1\xc1\xc1",  # not msgpack
        wire.frame(wire.Invalidate("w")).replace(b"Invalidate", b"Invalidatf"),  # no such tag
        wire.HEADER.pack(wire.MAX_FRAME_BYTES + 1),  # announces too much
        framed(NEGATIVE_KEY),  # well-formed msgpack, a key out of range
        wire.HEADER.pack(30) + msgspec.msgpack.encode(NEGATIVE_KEY)[:30],  # truncated msgpack
    ],
)
def test_a_hostile_peer_is_cut_off_and_the_shard_serves_on(
    shards: ShardSupervisor, frame: bytes
) -> None:
    paths = wait_for(shards)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(paths[0])
        sock.sendall(frame)
        sock.settimeout(10)
        assert sock.recv(100) == b""  # closed by the shard
    view = ShardedIndexView(paths, deadline_s=10.0)
    view.apply("hostile-check", pb.KvEventBatch(sequence=0))
    assert view.stats("hostile-check") is None  # (statistics come from status polls)
    assert all(a is not None for a in view.ask("score", [], 0))
    view.close()
