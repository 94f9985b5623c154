"""One index shard process: follows its workers' event streams into its own `FleetIndexView`
and answers router processes over a Unix socket.

A router process keeps two connections to each shard: a control connection (the workers it
follows, resyncs, status polls) and a query connection (scores, expectations). The shard
follows the union of what its live control connections ask for; a worker nobody follows any
more (its last router process closed the connection) is dropped after `release_after_s`, so
a router that restarts finds the view still warm.

    python -m kvroute.router.index_shards.server --socket PATH --shard I --generation G

reads its settings (`ShardSettings`, JSON) from the environment variable SETTINGS_ENV.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

from google.protobuf.message import DecodeError

from kvroute.proto import events_pb2
from kvroute.ratelog import RateLimitedLog
from kvroute.router.config import BreakerConfig, EventsConfig, WorkerSpec
from kvroute.router.fleet.event_subscriptions import EventSubscriptions, TransportFactory
from kvroute.router.fleet.event_subscriptions import default_transport as _default_transport
from kvroute.router.fleet.workers import WorkerRegistry
from kvroute.router.gc_tuning import tune_gc
from kvroute.router.index_shards import wire
from kvroute.router.ops.metrics import RouterMetrics, family_series
from kvroute.router.routing.fleet_index_view import FleetIndexView

log = logging.getLogger("kvroute.index_shard")
SETTINGS_ENV = "KVROUTE_INDEX_SHARD_SETTINGS"
_PEERCRED = struct.Struct("3i")


@dataclasses.dataclass(frozen=True, slots=True)
class ShardSettings:
    """What a shard takes from the router's config."""

    hash_unit: int = 16
    events: EventsConfig = dataclasses.field(default_factory=EventsConfig)
    release_after_s: float = 10.0
    log_level: str = "info"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ShardSettings:
        raw = json.loads(text or "{}")
        default = cls()
        return cls(
            hash_unit=int(raw.get("hash_unit", default.hash_unit)),
            events=EventsConfig(**raw.get("events", {})),
            release_after_s=float(raw.get("release_after_s", default.release_after_s)),
            log_level=str(raw.get("log_level", default.log_level)),
        )


def _spec(ref: wire.WorkerRef) -> WorkerSpec:
    return WorkerSpec(
        name=ref.name,
        url="http://127.0.0.1",  # never used: the shard only follows events
        bridge=ref.bridge,
        zmq=ref.zmq,
        replay=ref.replay,
        topic=ref.topic,
        dp_rank=ref.dp_rank,
    )


class Shard:
    """The shard's state and its answers to every message (no I/O of its own but the event
    subscriptions it starts)."""

    def __init__(
        self,
        settings: ShardSettings,
        shard: int = 0,
        generation: int = 0,
        transport_factory: TransportFactory | None = None,
    ) -> None:
        self.shard = shard
        self.generation = generation
        self._settings = settings
        events_cfg = settings.events
        # nothing to relay here: a batch is applied as soon as it arrives
        events_cfg = dataclasses.replace(events_cfg, apply_delay_s=0.0)
        self.view = FleetIndexView(
            settings.hash_unit,
            max_entries_per_worker=events_cfg.max_entries_per_worker,
            max_pending_per_worker=events_cfg.max_pending_per_worker,
        )
        factory: TransportFactory = transport_factory or (
            lambda w: _default_transport(w, events_cfg)
        )
        self.metrics = RouterMetrics()
        self.events = EventSubscriptions(self.view, events_cfg, self.metrics, factory)
        self._registry = WorkerRegistry(BreakerConfig(), max_workers=wire.MAX_WORKERS)
        self._registry.listen(self.events)
        self._holders: dict[str, set[int]] = {}  # worker -> control connections following it
        self._held: dict[int, set[str]] = {}  # connection -> workers it follows
        self._ratelog = RateLimitedLog(log, interval_s=10.0)
        self.bad_messages = 0
        self._handlers: dict[type, Callable[[int, Any], wire.Answer | wire.StatusAnswer | None]]
        self._handlers = {
            wire.Follow: self._follow,
            wire.Unfollow: self._unfollow,
            wire.Resync: lambda cid, m: self._resync(m.name),
            wire.StatusAsk: lambda cid, m: self.status(m.id),
            wire.Query: lambda cid, m: self.query(m),
            wire.Expect: lambda cid, m: self._expect(m),
            wire.Apply: lambda cid, m: self._apply(m),
            wire.Invalidate: lambda cid, m: self.view.invalidate(m.worker),
            wire.RemoveWorker: lambda cid, m: self.view.remove_worker(m.worker),
            wire.Alignment: lambda cid, m: self.view.set_alignment(m.worker, m.alignment),
        }

    async def start(self) -> None:
        await self.events.start()

    async def stop(self) -> None:
        await self.events.stop()

    def handle(self, conn: int, message: wire.ToShard) -> wire.Answer | wire.StatusAnswer | None:
        """Apply one message from connection `conn`; the answer to send back, if any."""
        return self._handlers[type(message)](conn, message)

    # -- following ------------------------------------------------------------------------
    def _follow(self, conn: int, msg: wire.Follow) -> None:
        held = self._held.setdefault(conn, set())
        for ref in msg.workers:
            held.add(ref.name)
            self._holders.setdefault(ref.name, set()).add(conn)
            spec = _spec(ref)
            current = self._registry.get(ref.name)
            if current is not None and current.spec == spec:
                continue
            if current is not None:  # moved (a new bridge address): follow it afresh
                self._registry.remove(ref.name)
            try:
                self._registry.add(spec)
            except ValueError as exc:
                self._ratelog.error(
                    "follow", "shard %d: cannot follow %s: %s", self.shard, ref.name, exc
                )

    def _resync(self, name: str) -> None:
        self.events.resync(name)

    def _unfollow(self, conn: int, msg: wire.Unfollow) -> None:
        held = self._held.get(conn, set())
        for name in msg.names:
            held.discard(name)
            self._release(conn, name, at_once=True)

    def closed(self, conn: int) -> None:
        """Connection `conn` is gone: its workers are dropped later unless followed again."""
        for name in self._held.pop(conn, set()):
            self._release(conn, name, at_once=False)

    def _release(self, conn: int, name: str, *, at_once: bool) -> None:
        holders = self._holders.get(name)
        if holders is None:
            return
        holders.discard(conn)
        if holders:
            return
        if at_once:
            self._drop(name)
        else:
            asyncio.get_running_loop().call_later(
                self._settings.release_after_s, self._drop_if_unheld, name
            )

    def _drop_if_unheld(self, name: str) -> None:
        if not self._holders.get(name):
            self._drop(name)

    def _drop(self, name: str) -> None:
        self._holders.pop(name, None)
        if self._registry.remove(name) is None:
            self.view.remove_worker(name)
        self.metrics.forget_worker(name)  # its series go with it, as in the router

    def followed(self) -> list[str]:
        return self._registry.names()

    # -- queries --------------------------------------------------------------------------
    def query(self, q: wire.Query) -> wire.Answer:
        view = self.view
        prompt = range(q.n_tokens)  # only its length is read when keys are given
        keys = wire.join_keys(q.keys, q.start)
        answer = wire.Answer(q.id, down=sorted(self.events.unusable()))
        if q.op == "score":
            answer.scores = dict(view.score(prompt, keys=keys))
        elif q.op == "reach":
            scores, coverage = view.reach(prompt, keys=keys)
            answer.scores = dict(scores)
            answer.coverage = dict(coverage)
        elif q.op == "explain":
            answer.explained = {
                w: wire.Explained(
                    e.reusable_tokens,
                    [
                        wire.Group(
                            g.group_id, g.kind, g.block_size, g.sliding_window, g.accepted_tokens
                        )
                        for g in e.groups
                    ],
                    e.alignment,
                    e.reason,
                    e.expected_tokens,
                )
                for w, e in view.explain(prompt, keys=keys).items()
            }
        elif q.op == "tiers":
            found = view.tiers(prompt, q.gpu or {}, keys=keys)
            answer.tiers = {w: (t.cpu, t.storage) for w, t in found.items()}
        else:
            raise wire.WireError(f"unknown query {q.op!r}")
        answer.tiered = bool(view.tier_index.workers())
        return answer

    def _expect(self, m: wire.Expect) -> None:
        keys = wire.join_keys(m.keys, m.start)
        self.view.expect(m.worker, range(m.n_tokens), "", "", m.ttl_s, keys, m.junction)

    def _apply(self, m: wire.Apply) -> None:
        try:
            if m.snapshot:
                self.view.apply_snapshot(m.worker, events_pb2.Snapshot.FromString(m.data))
            else:
                self.view.apply(m.worker, events_pb2.KvEventBatch.FromString(m.data))
        except DecodeError as exc:
            self.bad_messages += 1
            self._ratelog.warning("apply", "shard %d: undecodable events: %s", self.shard, exc)

    def status(self, ask_id: int) -> wire.StatusAnswer:
        now = time.monotonic()
        names = set(self._registry.names()) | set(self.view.index.workers())
        out = []
        for name in sorted(names):
            st = self.events.status(name)
            stats = self.view.stats(name)
            out.append(
                wire.WorkerStatus(
                    name,
                    st.state if st else "fed",
                    now - st.since if st else 0.0,
                    (now - st.last_message_at) if st and st.last_message_at is not None else None,
                    st.last_sequence if st else None,
                    st.stream_id if st else "",
                    st.snapshots if st else 0,
                    st.batches if st else 0,
                    st.reconnects if st else 0,
                    (st.last_error if st else "")[:4096],
                    stats.valid if stats else None,
                    stats.last_sequence if stats else None,
                    dict(stats.blocks_per_group) if stats else {},
                    stats.entries if stats else 0,
                    stats.pending if stats else 0,
                    stats.evicted if stats else 0,
                    stats.resets if stats else 0,
                )
            )
        series = [
            wire.Series(name, list(labels), values)
            for (name, labels), values in family_series(self.metrics.event_families())
        ]
        return wire.StatusAnswer(ask_id, self.shard, self.generation, out, series)


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return int(_PEERCRED.unpack(raw)[1])


class ShardServer:
    """Serves one `Shard` on a Unix socket; only this user's processes are answered."""

    def __init__(self, shard: Shard, path: str) -> None:
        self.shard = shard
        self.path = path
        self._server: asyncio.AbstractServer | None = None
        self._next_conn = 0
        self._ratelog = RateLimitedLog(log, interval_s=10.0)

    async def start(self) -> None:
        with_suppress_unlink(self.path)
        self._server = await asyncio.start_unix_server(self._serve, self.path, limit=1 << 16)
        os.chmod(self.path, 0o600)
        await self.shard.start()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        await self.shard.stop()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is None or peer_uid(sock) != os.getuid():
            self._ratelog.warning("peer", "shard %d: refused another user's peer", self.shard.shard)
            writer.close()
            return
        self._next_conn += 1
        conn = self._next_conn
        try:
            while True:
                header = await reader.readexactly(wire.HEADER.size)
                body = await reader.readexactly(wire.frame_length(header))
                answer = self.shard.handle(conn, wire.decode_to_shard(body))
                if answer is not None:
                    writer.write(wire.frame(answer))
                    await writer.drain()
                else:
                    # a reader with frames buffered does not yield on its own: let a query
                    # waiting on another connection go before this one's next batch
                    await asyncio.sleep(0)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except wire.WireError as exc:
            self.shard.bad_messages += 1
            self._ratelog.warning("wire", "shard %d: %s; connection closed", self.shard.shard, exc)
        except Exception as exc:  # a bug answering one message: this connection only
            self._ratelog.error("handle", "shard %d: %r; connection closed", self.shard.shard, exc)
        finally:
            self.shard.closed(conn)
            writer.close()


def with_suppress_unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


async def _watch_parent(parent: int) -> None:
    """Exit when the supervising process is gone (re-parented to init or a subreaper)."""
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    log.warning("index shard: the router process is gone; exiting")
    os._exit(0)


async def _run(args: argparse.Namespace, settings: ShardSettings) -> None:
    shard = Shard(settings, args.shard, args.generation)
    server = ShardServer(shard, args.socket)
    await server.start()
    log.info("index shard %d (generation %d) serving", args.shard, args.generation)
    try:
        await _watch_parent(args.parent)
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvroute index shard")
    p.add_argument("--socket", required=True)
    p.add_argument("--shard", type=int, required=True)
    p.add_argument("--generation", type=int, default=0)
    p.add_argument("--parent", type=int, default=os.getppid())
    args = p.parse_args(argv)
    settings = ShardSettings.from_json(os.environ.get(SETTINGS_ENV, "") or "{}")
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    tune_gc()  # as the router's: a shard holds millions of index objects the collector walks
    try:
        import uvloop

        uvloop.run(_run(args, settings))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
