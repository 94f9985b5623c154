"""A synthetic bridge for many engines: one gRPC `kvroute.v1.KvEvents` server whose dp_rank k
is engine k of a simulated fleet, each replaying the recorded busy engine of `fleet_model`.

The frames are the bridge's own (`fleet_model.bridge_frames`: the simulator's events through
the bridge's decoder, converter and `RankStream`), served by the bridge's own gRPC handler
(`kvroute.bridge.server.kv_events_handler`); only three things change per engine and send:
- content: every STORE that starts at token 0 gets token 0 = `engine_token(k)`, so each
  engine caches its own prompts (content keys chain, so everything below differs too);
- `sequence`, `timestamp` (the wall time the batch is due: the router's lag is measured from
  it) and `dp_rank`;
- where each engine starts: a new subscriber gets a snapshot of the recording at one of a few
  offsets in its full-cache part (built by the bridge's own code), then the batches after it
  at the recording's pace times `--rate-scale` (`--start empty`: an empty snapshot, then the
  recording from its start, which fills the cache first). An engine restarts (empty snapshot, new
  stream id, the recording from its empty start) after an exponential time of mean
  `--restart-interval-s` (engine time), or when its recording runs out.

Messages are assembled from pre-serialized parts (protobuf messages concatenate as a merge),
so one process can feed thousands of engines. Each subscriber's queue is bounded
(`QUEUE_SIZE`): a router that does not keep up fills it, and the engine is resynchronised with
a snapshot (reason "lagging"), as a real bridge does; that is counted as an overflow.

Prints "PORT <n>" once serving, then one JSON line of counters per second.

    python -m bench.fleet_feed --template run/template.pkl --engines 64 --rate-scale 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import math
import pickle
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from kvroute.bridge.server import kv_events_handler, start_grpc_server
from kvroute.bridge.stream import RankStream, Subscriber
from kvroute.proto.events_pb2 import (
    KvEventBatch,
    KvGroupEvent,
    Snapshot,
    SubscribeRequest,
    SubscribeResponse,
)

QUEUE_SIZE = 1024  # messages per subscriber (the bridge's default)
ENGINE_TOKEN_BASE = 1_000_000  # above any template token: engine k's root token


def engine_token(k: int) -> int:
    """Token 0 of every prompt engine k caches."""
    return ENGINE_TOKEN_BASE + k


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        bits = n & 0x7F
        n >>= 7
        if n:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


_SNAPSHOT_TAG = b"\x0a"  # SubscribeResponse.snapshot: field 1, length-delimited
_BATCH_TAG = b"\x12"  # SubscribeResponse.batch: field 2, length-delimited


def _is_root(event: KvGroupEvent) -> bool:
    return (
        event.operation == KvGroupEvent.STORE
        and not event.parent_block_hash
        and len(event.token_ids) > 0
    )


def _blocks(events: Any) -> int:
    return sum(len(e.block_hashes) for e in events)


@dataclass
class Piece:
    """One recorded batch, split into the STOREs from token 0 (patched per engine) and the
    rest (serialized once, as `events` entries)."""

    t: float  # modelled seconds since the engine started empty
    sequence: int
    roots: list[KvGroupEvent]
    rest: bytes
    blocks: int


@dataclass
class Start:
    """A snapshot of the recording: the pieces before `next_piece` are in it."""

    next_piece: int
    sequence: int
    roots: list[KvGroupEvent]
    rest: bytes  # every other Snapshot field, serialized


@dataclass
class Template:
    pieces: list[Piece]
    starts: list[Start]

    @classmethod
    def load(cls, path: Path) -> Template:
        data = pickle.loads(path.read_bytes())
        pieces = []
        for t, raw in data["frames"]:
            batch = SubscribeResponse.FromString(raw).batch
            roots = [e for e in batch.events if _is_root(e)]
            rest = KvEventBatch(events=[e for e in batch.events if not _is_root(e)])
            rest.tier_events.extend(batch.tier_events)
            pieces.append(
                Piece(t, batch.sequence, roots, rest.SerializeToString(), _blocks(batch.events))
            )
        starts = []
        for next_piece, raw in data["snapshots"]:
            snap = SubscribeResponse.FromString(raw).snapshot
            roots = [e for e in snap.events if _is_root(e)]
            rest_snap = Snapshot(events=[e for e in snap.events if not _is_root(e)])
            rest_snap.lineage.extend(snap.lineage)
            rest_snap.tier_events.extend(snap.tier_events)
            rest_snap.tier_lineage.extend(snap.tier_lineage)
            starts.append(Start(next_piece, snap.sequence, roots, rest_snap.SerializeToString()))
        return cls(pieces, starts)


def _patched(roots: list[KvGroupEvent], token: int) -> list[KvGroupEvent]:
    out = []
    for root in roots:
        event = KvGroupEvent()
        event.CopyFrom(root)
        event.token_ids[0] = token
        out.append(event)
    return out


@dataclass
class Counters:
    batches: int = 0
    blocks: int = 0
    bytes: int = 0
    snapshots: int = 0
    snapshot_bytes: int = 0
    restarts: int = 0
    overflows: int = 0
    subscribed: int = 0
    late_max_s: float = 0.0
    late_sum_s: float = 0.0


@dataclass
class EngineFeed:
    """Engine k's stream (the `RankStream` face the bridge's gRPC handler uses)."""

    k: int
    fleet: Fleet
    subscriber: Subscriber | None = None
    epoch: int = 0
    piece: int = 0  # next piece to send
    origin_wall: float = 0.0  # wall time at which modelled time `origin_t` is due
    origin_t: float = 0.0
    restart_at: float = math.inf  # wall time of the next restart
    sequence: int = 0
    token: int = field(init=False)

    def __post_init__(self) -> None:
        self.token = engine_token(self.k)

    # -- what kv_events_handler calls --------------------------------------------------
    def subscribe(self, request: SubscribeRequest) -> Subscriber:
        if self.subscriber is None:
            self.fleet.counters.subscribed += 1
        self.subscriber = Subscriber(QUEUE_SIZE)
        self._start(self.fleet.start_of(self.k), "initial")
        return self.subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        if subscriber is self.subscriber:
            self.subscriber = None
            self.fleet.counters.subscribed -= 1
            self.epoch += 1  # its scheduled sends lapse

    # -- the engine ------------------------------------------------------------------------
    def _start(self, start: Start | None, reason: str) -> None:
        """Send a snapshot (None: empty, the engine restarted) and schedule what follows."""
        fleet = self.fleet
        self.epoch += 1
        now = time.time()
        snap = Snapshot(
            sequence=0 if start is None else start.sequence,
            has_sequence=True,
            dp_rank=self.k,
            stream_id=f"fleet/{self.k}/{self.epoch}",
            reason=reason,
        )
        rest = b""
        if start is not None:
            snap.events.extend(_patched(start.roots, self.token))
            rest = start.rest
        body = snap.SerializeToString() + rest
        self._offer(_SNAPSHOT_TAG + _varint(len(body)) + body)
        fleet.counters.snapshots += 1
        fleet.counters.snapshot_bytes += len(body)
        self.piece = 0 if start is None else start.next_piece
        self.sequence = 0 if start is None else start.sequence
        pieces = fleet.template.pieces
        self.origin_t = pieces[self.piece].t if self.piece < len(pieces) else 0.0
        self.origin_wall = now + fleet.rng.random() * 0.05  # engines are not in step
        self.restart_at = now + fleet.rng.expovariate(1.0) * fleet.restart_wall_s
        fleet.schedule(self)

    def due(self) -> float:
        """Wall time the next piece is due."""
        return (
            self.origin_wall
            + (self.fleet.template.pieces[self.piece].t - self.origin_t) / self.fleet.rate_scale
        )

    def send_due(self, now: float) -> None:
        """Send every piece due by `now` (then the fleet schedules the next)."""
        fleet = self.fleet
        pieces = fleet.template.pieces
        while True:
            if self.piece >= len(pieces) or now >= self.restart_at:
                fleet.counters.restarts += 1
                self._start(None, "restart")
                return
            due = self.due()
            if due > now:
                fleet.schedule(self)
                return
            piece = pieces[self.piece]
            self.piece += 1
            self.sequence += 1
            head = KvEventBatch(sequence=self.sequence, timestamp=due, dp_rank=self.k)
            if piece.roots:
                head.events.extend(_patched(piece.roots, self.token))
            body = head.SerializeToString() + piece.rest
            c = fleet.counters
            late = now - due
            c.late_sum_s += late
            c.late_max_s = max(c.late_max_s, late)
            if not self._offer(_BATCH_TAG + _varint(len(body)) + body):
                c.overflows += 1
                self._start(fleet.start_of(self.k), "lagging")
                return
            c.batches += 1
            c.blocks += piece.blocks
            c.bytes += len(body)

    def _offer(self, message: bytes) -> bool:
        sub = self.subscriber
        if sub is None:
            return True
        if sub.offer(message):
            return True
        sub.clear()  # a snapshot replaces what it could not take
        return False


class Fleet:
    """Every engine, and one timer that sends each engine's batches when due."""

    def __init__(
        self,
        template: Template,
        engines: int,
        rate_scale: float,
        restart_interval_s: float,
        empty_start: bool = False,
    ) -> None:
        if rate_scale <= 0:
            raise ValueError("rate_scale must be positive")
        self.template = template
        self.rate_scale = rate_scale
        self.restart_wall_s = restart_interval_s / rate_scale
        self.empty_start = empty_start
        self.rng = random.Random(0)
        self.counters = Counters()
        self.engines = [EngineFeed(k, self) for k in range(engines)]
        self._heap: list[tuple[float, int, int]] = []  # (due, engine, epoch)
        self._wake = asyncio.Event()

    def start_of(self, k: int) -> Start | None:
        """Where engine k starts: a full cache (one of the template's snapshots) or empty."""
        if self.empty_start:
            return None
        return self.template.starts[k % len(self.template.starts)]

    def stream(self, dp_rank: int) -> RankStream | None:
        if 0 <= dp_rank < len(self.engines):
            return cast(RankStream, self.engines[dp_rank])  # duck-typed: subscribe/unsubscribe
        return None

    def schedule(self, engine: EngineFeed) -> None:
        due = min(engine.due() if engine.piece < len(self.template.pieces) else 0.0,
                  engine.restart_at)  # fmt: skip
        heapq.heappush(self._heap, (due, engine.k, engine.epoch))
        self._wake.set()

    async def run(self) -> None:
        heap = self._heap
        while True:
            now = time.time()
            while heap and heap[0][0] <= now:
                _, k, epoch = heapq.heappop(heap)
                engine = self.engines[k]
                if epoch == engine.epoch and engine.subscriber is not None:
                    engine.send_due(now)
            self._wake.clear()
            wait = min(heap[0][0] - time.time(), 0.05) if heap else 0.05
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)
            else:
                await asyncio.sleep(0)  # let the gRPC handlers send


async def _report(fleet: Fleet) -> None:
    started = time.monotonic()
    while True:
        await asyncio.sleep(1.0)
        c = fleet.counters
        line = {"t": round(time.monotonic() - started, 1), **vars(c)}
        line["late_mean_s"] = c.late_sum_s / c.batches if c.batches else 0.0
        print(json.dumps(line), flush=True)
        c.late_max_s = 0.0  # per second


async def serve(args: argparse.Namespace) -> None:
    template = Template.load(args.template)
    fleet = Fleet(
        template, args.engines, args.rate_scale, args.restart_interval_s, args.start == "empty"
    )
    handler = kv_events_handler(fleet.stream)
    server, port = await start_grpc_server(f"{args.host}:{args.port}", handler)
    print(f"PORT {port}", flush=True)
    try:
        await asyncio.gather(fleet.run(), _report(fleet))
    finally:
        await server.stop(grace=None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--template", type=Path, required=True, help="from fleet_scale_bench")
    p.add_argument("--engines", type=int, required=True)
    p.add_argument("--rate-scale", type=float, default=1.0, help="x the recorded pace (0-1]")
    p.add_argument(
        "--restart-interval-s",
        type=float,
        default=3600.0,
        help="mean engine seconds between an engine's restarts",
    )
    p.add_argument(
        "--start",
        choices=("full", "empty"),
        default="full",
        help="engines start from a snapshot of a full cache, or empty (then fill)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
