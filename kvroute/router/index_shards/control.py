"""The router's control connections to the index shards: which workers each shard follows
for this router process, their stream status and index statistics (polled), resyncs.

`ShardedEvents` stands where `EventSubscriptions` stands when the index runs in shard
processes: the registry tells it of workers added and removed (static config, admin API,
discovery alike) and it tells the owning shard; the proxy asks it which workers' streams are
not live; admin and metrics read stream status from it. A lost control connection is opened
again with backoff and the shard is told the full set again (a restarted shard then
subscribes afresh, from a snapshot).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvroute.ratelog import RateLimitedLog
from kvroute.router.fleet.event_subscriptions import CONNECTING, LIVE, StreamStatus
from kvroute.router.fleet.workers import Worker
from kvroute.router.index_shards import wire
from kvroute.router.index_shards.client import ShardedIndexView
from kvroute.router.ops.metrics import SeriesKey
from kvroute.router.routing.index_view import IndexStats

log = logging.getLogger("kvroute.router.index_shards")
MAX_CONTROL_BACKLOG = 4 * 1024 * 1024  # unsent control bytes before the connection is reset
# a local socket's connect costs microseconds: a restarted shard is found within this
MAX_RECONNECT_DELAY_S = 0.5


def _ref(worker: Worker) -> wire.WorkerRef:
    s = worker.spec
    return wire.WorkerRef(s.name, s.bridge, s.zmq, s.replay, s.topic, s.dp_rank)


class _Control:
    """One shard's control connection, as seen by this router process."""

    def __init__(self, shard: int, path: str) -> None:
        self.shard = shard
        self.path = path
        self.writer: asyncio.StreamWriter | None = None
        self.workers: dict[str, wire.WorkerRef] = {}  # followed through this shard
        self.unconfirmed: set[str] = set()  # told to follow, no status since
        self.down: frozenset[str] = frozenset()  # from the latest status answer
        self.answered = False  # a status answer since this connection opened
        self.generation: int | None = None
        # the shard's event series: as of its latest answer, and summed over its earlier
        # generations (a restarted shard counts from zero; the router's counters must not)
        self.series: dict[SeriesKey, list[float]] = {}
        self.base: dict[SeriesKey, list[float]] = {}

    def send(self, message: wire.ToShard) -> None:
        w = self.writer
        if w is None or w.is_closing():
            return  # sent in full with Follow when the connection opens
        w.write(wire.frame(message))
        if w.transport.get_write_buffer_size() > MAX_CONTROL_BACKLOG:
            w.close()  # the shard reads nothing: start afresh


class ShardedEvents:
    """The shards' event subscriptions, for this router process (a registry listener)."""

    def __init__(
        self,
        view: ShardedIndexView,
        paths: list[str],
        *,
        status_interval_s: float = 1.0,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._view = view
        self._controls = [_Control(i, p) for i, p in enumerate(paths)]
        self._interval = status_interval_s
        self._clock = clock
        self._status: dict[str, StreamStatus] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._ratelog = RateLimitedLog(log, interval_s=10.0)
        self._next_ask = 0
        self.up = Gauge(
            "kvroute_index_shard_up",
            "1 when this router process has a control connection to the index shard and its "
            "status answer",
            ["shard"],
            registry=registry,
        )
        self.restarts = Counter(
            "kvroute_index_shard_restarts",
            "Index shard processes restarted since this router process started (seen as a "
            "new generation)",
            ["shard"],
            registry=registry,
        )
        for c in self._controls:
            self.up.labels(str(c.shard)).set(0)

    # -- registry listener --------------------------------------------------------------
    def worker_added(self, worker: Worker) -> None:
        if not (worker.spec.bridge or worker.spec.zmq):
            return
        c = self._controls[self._view.owner(worker.name)]
        ref = _ref(worker)
        c.workers[worker.name] = ref
        c.unconfirmed.add(worker.name)
        c.send(wire.Follow([ref]))

    def worker_removed(self, worker: Worker) -> None:
        c = self._controls[self._view.owner(worker.name)]
        if c.workers.pop(worker.name, None) is None:
            return
        c.unconfirmed.discard(worker.name)
        c.base = {k: v for k, v in c.base.items() if worker.name not in k[1]}
        self._status.pop(worker.name, None)
        self._view.note_stats(worker.name, None)
        c.send(wire.Unfollow([worker.name]))

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        for c in self._controls:
            self._tasks.append(
                asyncio.create_task(self._keep(c), name=f"kvroute-index-shard-{c.shard}")
            )

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self._view.close()

    # -- queries --------------------------------------------------------------------------
    def ready(self) -> bool:
        """Every shard reachable and answering."""
        return all(c.answered for c in self._controls)

    def status(self, name: str) -> StreamStatus | None:
        return self._status.get(name)

    def unusable(self) -> set[str]:
        """Workers whose stream is not live as of the shards' latest word (a down shard:
        all of its workers)."""
        out: set[str] = set()
        for c in self._controls:
            if not c.workers:
                continue
            if not c.answered:
                out.update(c.workers)
                continue
            out |= c.unconfirmed
            out.update(n for n in self._view.down[c.shard] if n in c.workers)
        return out

    def event_series(self) -> Mapping[SeriesKey, list[float]]:
        """The shards' `kvroute_event_*` series summed over shards and their generations
        (`kvroute.router.ops.metrics.RelayedFamilies` exports them)."""
        out: dict[SeriesKey, list[float]] = {}
        for c in self._controls:
            for part in (c.base, c.series):
                for key, values in part.items():
                    _add(out, key, values)
        return out

    def resync(self, name: str) -> bool:
        """Have the owning shard discard the worker's view and resubscribe (a snapshot)."""
        c = self._controls[self._view.owner(name)]
        if name not in c.workers or c.writer is None:
            return False
        c.send(wire.Resync(name))
        return True

    # -- the control loop ---------------------------------------------------------------
    async def _keep(self, c: _Control) -> None:
        delay = 0.05
        while True:
            try:
                await self._connected(c)
                delay = 0.05
            except asyncio.CancelledError:
                raise
            except (OSError, wire.WireError, asyncio.IncompleteReadError) as exc:
                if c.answered:
                    self._ratelog.warning(
                        f"lost-{c.shard}", "index shard %d: connection lost (%s)", c.shard, exc
                    )
            finally:
                if c.writer is not None:
                    c.writer.close()
                c.writer = None
                self._lost(c)
            await asyncio.sleep(delay * (0.8 + 0.4 * random.random()))
            delay = min(delay * 2, MAX_RECONNECT_DELAY_S)

    def _lost(self, c: _Control) -> None:
        """The shard's word no longer holds: its workers show as connecting (not the dead
        process's last "live") and have no index statistics until the shard answers again."""
        if c.answered:
            now = self._clock()
            why = f"index shard {c.shard} unreachable"
            for name in c.workers:
                self._status[name] = StreamStatus(state=CONNECTING, since=now, last_error=why)
                self._view.note_stats(name, None)
        c.answered = False
        self.up.labels(str(c.shard)).set(0)

    async def _connected(self, c: _Control) -> None:
        reader, writer = await asyncio.open_unix_connection(c.path, limit=1 << 16)
        c.writer = writer
        c.unconfirmed = set(c.workers)
        c.send(wire.Follow(list(c.workers.values())))
        poller = asyncio.create_task(self._poll(c))
        try:
            while True:
                header = await reader.readexactly(wire.HEADER.size)
                body = await reader.readexactly(wire.frame_length(header))
                message = wire.decode_from_shard(body)
                if isinstance(message, wire.StatusAnswer):
                    self._apply_status(c, message)
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller

    async def _poll(self, c: _Control) -> None:
        while True:
            self._next_ask += 1
            c.send(wire.StatusAsk(self._next_ask))
            await asyncio.sleep(self._interval)

    def _apply_status(self, c: _Control, answer: wire.StatusAnswer) -> None:
        if c.generation is not None and answer.generation > c.generation:
            self.restarts.labels(str(c.shard)).inc(answer.generation - c.generation)
            for key, values in c.series.items():
                _add(c.base, key, values)
        c.generation = answer.generation
        c.series = {(s.family, tuple(s.labels)): s.values for s in answer.series}
        now = self._clock()
        seen: set[str] = set()
        down: set[str] = set()
        for ws in answer.workers:
            if ws.name not in c.workers:
                continue
            seen.add(ws.name)
            if ws.state != LIVE:
                down.add(ws.name)
            self._status[ws.name] = StreamStatus(
                state=ws.state,
                since=now - ws.since_age_s,
                last_message_at=None if ws.message_age_s is None else now - ws.message_age_s,
                last_sequence=ws.last_sequence,
                stream_id=ws.stream_id,
                snapshots=ws.snapshots,
                batches=ws.batches,
                reconnects=ws.reconnects,
                last_error=ws.last_error,
            )
            self._view.note_stats(
                ws.name,
                None
                if ws.valid is None
                else IndexStats(
                    ws.valid,
                    ws.index_sequence,
                    dict(ws.blocks_per_group),
                    ws.entries,
                    ws.pending,
                    ws.evicted,
                    ws.resets,
                ),
            )
        for name in c.workers.keys() - seen:
            down.add(name)
            self._status.setdefault(name, StreamStatus(state=CONNECTING))
        c.down = frozenset(down)
        self._view.down[c.shard] = c.down
        c.unconfirmed.clear()
        if not c.answered:
            c.answered = True
            self.up.labels(str(c.shard)).set(1)


def _add(into: dict[SeriesKey, list[float]], key: SeriesKey, values: list[float]) -> None:
    """Add a series' numbers into `into` (a series of another shape replaces it)."""
    have = into.get(key)
    if have is None or len(have) != len(values):
        into[key] = list(values)
    else:
        into[key] = [a + b for a, b in zip(have, values, strict=True)]
