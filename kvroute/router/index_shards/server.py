"""One index shard process: follows its workers' event streams into its own `FleetIndexView`
and answers router processes over a Unix socket.

A router process keeps two connections to each shard: a control connection (the workers it
follows, resyncs, status polls) and a query connection (scores, expectations). The shard
follows the union of what its live control connections ask for; a worker nobody follows any
more (its last router process closed the connection) is dropped after `release_after_s`, so
a router that restarts finds the view still warm.

Queries go first. Ingest (a batch from a worker's stream or an `Apply` frame, a step of a
snapshot) runs on the same event loop as the answers, and a loop that has many batches ready
runs them all before it reads a socket again: a query would wait behind that run. So before
each batch or snapshot step the shard reads its sockets itself and answers the queries that
wait there (`ShardServer.answer_waiting`), at most `MAX_QUERIES_AHEAD` of them per batch, so
ingest always moves on. Only a query (and an `Expect`, which changes no indexed content) at
the head of its connection jumps ahead: every other message is handled in its connection's
order, and a connection's own batches are applied in order before its later messages.

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
import select
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
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
MAX_QUERIES_AHEAD = 16  # queries answered ahead of one batch (ingest is never starved)
SLICE_S = 0.002  # a connection's frames handled before the loop gets a turn (at least one)
MAX_INBOX = 256  # frames read ahead of handling, per connection (then the socket is not read)
MAX_OUTBOX_BYTES = 64 * 1024 * 1024  # unsent answer bytes before the connection is closed
_READ_CHUNK = 1 << 20
_JUMPS = (wire.Query, wire.Expect)  # may be handled ahead of batches waiting elsewhere


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


class GatedView(FleetIndexView):
    """The shard's view: `gate` runs before each batch, snapshot and snapshot step is applied
    (the shard answers the queries waiting meanwhile)."""

    def __init__(self, hash_unit: int, **kwargs: Any) -> None:
        super().__init__(hash_unit, **kwargs)
        self.gate: Callable[[], None] = lambda: None

    def apply(self, worker: str, batch: events_pb2.KvEventBatch) -> None:
        self.gate()
        super().apply(worker, batch)

    def apply_snapshot(self, worker: str, snapshot: events_pb2.Snapshot) -> None:
        self.gate()
        super().apply_snapshot(worker, snapshot)

    def apply_snapshot_steps(
        self, worker: str, snapshot: events_pb2.Snapshot, blocks_per_step: int
    ) -> Iterator[None]:
        steps = super().apply_snapshot_steps(worker, snapshot, blocks_per_step)
        close = getattr(steps, "close", None)
        try:
            while True:
                self.gate()
                try:
                    next(steps)
                except StopIteration:
                    return
                yield
        finally:
            if close is not None:
                close()  # cancelled midway: the index drops the snapshot


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
        self.view = GatedView(
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


class _Conn:
    """One peer's connection: frames read and not yet handled, answers not yet sent."""

    __slots__ = ("busy", "fd", "frames", "id", "inbox", "outbox", "reading", "scheduled", "sock")

    def __init__(self, conn_id: int, sock: socket.socket) -> None:
        self.id = conn_id
        self.sock = sock
        self.fd = sock.fileno()
        self.frames = wire.FrameReader()
        self.inbox: deque[wire.ToShard] = deque()
        self.outbox = bytearray()
        self.busy = False  # its frames are being handled (a batch of its own is applying)
        self.scheduled = False  # a turn to handle its inbox is due on the loop
        self.reading = False  # its socket is watched by the loop


class ShardServer:
    """Serves one `Shard` on a Unix socket; only this user's processes are answered.

    The connections are plain non-blocking sockets that the shard reads itself: from the
    loop when one is readable, and from `answer_waiting` before each batch is applied."""

    def __init__(self, shard: Shard, path: str) -> None:
        self.shard = shard
        self.path = path
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conns: dict[int, _Conn] = {}  # by fd
        self._poll = select.poll()
        self._next_conn = 0
        self._answering = False
        self._ratelog = RateLimitedLog(log, interval_s=10.0)

    async def start(self) -> None:
        with_suppress_unlink(self.path)
        self._loop = asyncio.get_running_loop()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        os.chmod(self.path, 0o600)
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self._loop.add_reader(listener.fileno(), self._accept)
        self.shard.view.gate = self.answer_waiting
        await self.shard.start()

    async def stop(self) -> None:
        if self._listener is not None and self._loop is not None:
            self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
        for conn in list(self._conns.values()):
            self._close(conn)
        self.shard.view.gate = lambda: None
        await self.shard.stop()

    # -- connections ----------------------------------------------------------------------
    def _accept(self) -> None:
        assert self._listener is not None and self._loop is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._ratelog.warning("accept", "shard %d: accept: %s", self.shard.shard, exc)
                return
            if peer_uid(sock) != os.getuid():
                self._ratelog.warning(
                    "peer", "shard %d: refused another user's peer", self.shard.shard
                )
                sock.close()
                continue
            sock.setblocking(False)
            self._next_conn += 1
            conn = _Conn(self._next_conn, sock)
            self._conns[conn.fd] = conn
            self._poll.register(conn.fd, select.POLLIN)
            self._watch(conn, True)

    def _watch(self, conn: _Conn, on: bool) -> None:
        """Have the loop read `conn` when readable (or not: its inbox is full)."""
        if on == conn.reading or self._loop is None:
            return
        conn.reading = on
        if on:
            self._loop.add_reader(conn.fd, self._readable, conn)
        else:
            self._loop.remove_reader(conn.fd)

    def _close(self, conn: _Conn) -> None:
        if self._conns.pop(conn.fd, None) is None:
            return
        self._poll.unregister(conn.fd)
        if self._loop is not None:
            if conn.reading:
                self._loop.remove_reader(conn.fd)
            self._loop.remove_writer(conn.fd)
        conn.inbox.clear()
        conn.sock.close()
        self.shard.closed(conn.id)

    def _read(self, conn: _Conn) -> bool:
        """Read what the socket holds into the inbox (not past MAX_INBOX frames); False if
        the connection is gone (closed by the peer, or a bad frame: closed here)."""
        while len(conn.inbox) < MAX_INBOX:
            try:
                data = conn.sock.recv(_READ_CHUNK)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                self._close(conn)
                return False
            if not data:
                self._close(conn)
                return False
            try:
                conn.inbox.extend(wire.decode_to_shard(b) for b in conn.frames.feed(data))
            except wire.WireError as exc:
                self.shard.bad_messages += 1
                self._ratelog.warning(
                    "wire", "shard %d: %s; connection closed", self.shard.shard, exc
                )
                self._close(conn)
                return False
        return True

    def _send(self, conn: _Conn, data: bytes) -> None:
        if not conn.outbox:
            try:
                n = conn.sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError:
                self._close(conn)
                return
            if n == len(data):
                return
            data = data[n:]
            if self._loop is not None:
                self._loop.add_writer(conn.fd, self._writable, conn)
        conn.outbox += data
        if len(conn.outbox) > MAX_OUTBOX_BYTES:  # the peer reads nothing: let it start afresh
            self._ratelog.warning(
                "outbox", "shard %d: a peer does not read its answers; closed", self.shard.shard
            )
            self._close(conn)

    def _writable(self, conn: _Conn) -> None:
        try:
            n = conn.sock.send(conn.outbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        del conn.outbox[:n]
        if not conn.outbox and self._loop is not None:
            self._loop.remove_writer(conn.fd)

    def _handle(self, conn: _Conn, message: wire.ToShard) -> bool:
        """Handle one message and send its answer; False if the connection was closed."""
        try:
            answer = self.shard.handle(conn.id, message)
        except Exception as exc:  # a bug answering one message: this connection only
            self._ratelog.error("handle", "shard %d: %r; connection closed", self.shard.shard, exc)
            self._close(conn)
            return False
        if answer is not None:
            try:
                data = wire.frame(answer)
            except wire.WireError as exc:
                self._ratelog.error("answer", "shard %d: %s", self.shard.shard, exc)
                self._close(conn)
                return False
            self._send(conn, data)
        return conn.fd in self._conns

    # -- the loop's turns -----------------------------------------------------------------
    def _readable(self, conn: _Conn) -> None:
        if self._read(conn):
            self._drain(conn)

    def _turn(self, conn: _Conn) -> None:
        conn.scheduled = False
        if conn.fd in self._conns and not conn.busy:
            self._drain(conn)

    def _drain(self, conn: _Conn) -> None:
        """Handle the connection's frames in order for up to SLICE_S (at least one), then
        give the loop a turn if some remain; read on once its inbox is empty."""
        if conn.busy:
            return
        conn.busy = True
        started = time.perf_counter()
        try:
            while conn.inbox:
                if not self._handle(conn, conn.inbox.popleft()):
                    return
                if conn.inbox and time.perf_counter() - started >= SLICE_S:
                    break
        finally:
            conn.busy = False
        if conn.fd not in self._conns:
            return
        if conn.inbox:
            self._watch(conn, False)  # its sender waits (the kernel's buffers fill)
            self._schedule(conn)
        else:
            self._watch(conn, True)

    def _schedule(self, conn: _Conn) -> None:
        if not conn.scheduled and self._loop is not None:
            conn.scheduled = True
            self._loop.call_soon(self._turn, conn)

    def answer_waiting(self) -> None:
        """Before a batch is applied: read every connection that has bytes waiting, and
        handle the queries (and expectations) at the head of each connection's frames, at
        most MAX_QUERIES_AHEAD in all. A connection whose own batch is being applied is
        left alone (its later frames follow that batch)."""
        if self._answering or not self._conns:
            return
        self._answering = True
        try:
            ready = {fd for fd, _ in self._poll.poll(0)}
            budget = MAX_QUERIES_AHEAD
            for conn in list(self._conns.values()):
                if conn.busy or conn.fd not in self._conns:
                    continue
                if conn.fd in ready and not self._read(conn):
                    continue
                while budget and conn.inbox and isinstance(conn.inbox[0], _JUMPS):
                    budget -= 1
                    self.shard.metrics.event_queries_ahead.inc()
                    if not self._handle(conn, conn.inbox.popleft()):
                        break
                if conn.fd in self._conns and conn.inbox:
                    self._watch(conn, False)
                    self._schedule(conn)  # the rest in its order, on the loop
        finally:
            self._answering = False


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
