"""The router's side of the index shards: `ShardedIndexView`, an `IndexView` whose queries go
to every shard at once and whose answers are merged, within a deadline.

The view is called on the router's event loop and answers synchronously, as the in-process
index does; it sends a query to every shard over its own non-blocking Unix socket and waits
in `poll` for the answers, at most `deadline_s`. A shard that does not answer in time (or is
down) contributes nothing: its workers have no evidence in that decision, the miss is counted
(`kvroute_index_shard_missed_total`) and logged once per interval. Its late answer is read
and dropped with the next query; a shard that falls `MAX_OUTSTANDING` answers behind is not
asked again until it catches up, so nothing queues without bound.
"""

from __future__ import annotations

import logging
import select
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvroute.indexer import content_keys
from kvroute.proto import events_pb2
from kvroute.ratelog import RateLimitedLog
from kvroute.router.index_shards import wire
from kvroute.router.index_shards.assign import shard_of
from kvroute.router.routing.fleet_index_view import _ns
from kvroute.router.routing.index_view import (
    IndexStats,
    ReuseExplanation,
    TierReuse,
)

log = logging.getLogger("kvroute.router.index_shards")

MAX_OUTSTANDING = 8  # unanswered queries to one shard before it is skipped
MAX_OUTBOX_BYTES = 8 * 1024 * 1024  # unsent bytes to one shard before the link is reset
_READ_CHUNK = 1 << 20
_IN = select.POLLIN | select.POLLHUP | select.POLLERR


class QueryLink:
    """One non-blocking connection to a shard's socket, reconnected lazily with backoff."""

    def __init__(self, path: str, shard: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.shard = shard
        self._clock = clock
        self.sock: socket.socket | None = None
        self._reader = wire.FrameReader()
        self._outbox = bytearray()
        self.outstanding = 0
        self._retry_at = 0.0
        self._backoff = 0.05
        self.connects = 0

    def fileno(self) -> int:
        return self.sock.fileno() if self.sock is not None else -1

    def ensure(self) -> bool:
        """Connected (connecting now if the backoff allows)."""
        if self.sock is not None:
            return True
        now = self._clock()
        if now < self._retry_at:
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            self._retry_at = now + self._backoff
            self._backoff = min(self._backoff * 2, 1.0)
            return False
        sock.setblocking(False)
        self.sock = sock
        self._backoff = 0.05
        self.connects += 1
        return True

    def reset(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = None
        self._reader = wire.FrameReader()
        self._outbox.clear()
        self.outstanding = 0
        self._retry_at = self._clock() + self._backoff

    def send(self, data: bytes) -> bool:
        """Queue one frame and write what the socket takes now; False if not connected. An
        older connection found dead on sending (its shard restarted) is replaced at once."""
        older = self.sock is not None
        if not self.ensure():
            return False
        self._outbox += data
        self.flush()
        if self.sock is None and older:  # the restarted shard may be listening already
            self._retry_at = 0.0
            if not self.ensure():
                return False
            self._outbox += data
            self.flush()
        if len(self._outbox) > MAX_OUTBOX_BYTES:  # the shard reads nothing: start afresh
            self.reset()
            return False
        return self.sock is not None

    def flush(self) -> None:
        while self._outbox and self.sock is not None:
            try:
                n = self.sock.send(self._outbox)
            except BlockingIOError:
                return
            except OSError:
                self.reset()
                return
            del self._outbox[:n]

    def wants_write(self) -> bool:
        return bool(self._outbox)

    def receive(self) -> list[wire.FromShard]:
        """Every message the socket holds now (resets the link on EOF or a bad frame)."""
        out: list[wire.FromShard] = []
        while self.sock is not None:
            try:
                data = self.sock.recv(_READ_CHUNK)
            except BlockingIOError:
                break
            except OSError:
                self.reset()
                break
            if not data:
                self.reset()
                break
            try:
                out.extend(wire.decode_from_shard(b) for b in self._reader.feed(data))
            except wire.WireError:
                self.reset()
                raise
        return out


class ShardedIndexView:
    """`IndexView` over K shard processes (sockets `paths[i]`), each owning the workers
    `shard_of(name, K) == i`."""

    def __init__(
        self,
        paths: Sequence[str],
        hash_unit: int = 16,
        *,
        deadline_s: float = 0.01,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.links = [QueryLink(p, i, clock) for i, p in enumerate(paths)]
        self.hash_unit = hash_unit
        self.deadline_s = deadline_s
        self._next_id = 0
        # per shard, from its latest answer: followed workers not live; lower tiers in use
        self.down: list[frozenset[str]] = [frozenset()] * len(paths)
        self._tiered: list[bool] = [True] * len(paths)  # unknown: ask
        self._stats: dict[str, IndexStats] = {}
        self._ratelog = RateLimitedLog(log, interval_s=10.0)
        self.missed = Counter(
            "kvroute_index_shard_missed",
            "Index queries a shard did not answer within index.deadline_s (or was down for): "
            "its workers had no evidence in that decision",
            ["shard"],
            registry=registry,
        )
        self.bad = Counter(
            "kvroute_index_shard_bad_answers",
            "Undecodable answers from an index shard (the connection is reset)",
            ["shard"],
            registry=registry,
        )
        self.query_seconds = Histogram(
            "kvroute_index_query_seconds",
            "Wall time of one index query across all shards (send, wait, merge)",
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1),
            registry=registry,
        )

    @property
    def shards(self) -> int:
        return len(self.links)

    def owner(self, worker: str) -> int:
        return shard_of(worker, len(self.links))

    # -- the fan-out ----------------------------------------------------------------------
    def ask(
        self,
        op: str,
        keys: Sequence[int],
        n_tokens: int,
        gpu: Sequence[Mapping[str, int | None]] | None = None,
        only: Sequence[bool] | None = None,
    ) -> list[wire.Answer | None]:
        """Send the query to every shard (`only[i]` False: skip shard i; `gpu[i]`: shard i's
        part of a tiers query) and collect answers until the deadline; None: no answer."""
        started = time.perf_counter()
        self._next_id += 1
        qid = self._next_id
        low, start = wire.split_keys(keys)
        shared = (
            None if gpu is not None else wire.frame(wire.Query(qid, op, low, n_tokens, None, start))
        )
        got: list[wire.Answer | None] = [None] * len(self.links)
        waiting: dict[int, QueryLink] = {}
        for i, link in enumerate(self.links):
            if only is not None and not only[i]:
                continue
            if link.outstanding:  # late answers that arrived since: read and dropped
                self._read(link, qid, got)
            if link.outstanding >= MAX_OUTSTANDING:
                self._miss(i, "is too far behind")
                continue
            data = shared
            if data is None:
                assert gpu is not None
                data = wire.frame(wire.Query(qid, op, low, n_tokens, dict(gpu[i]), start))
            if not link.send(data):
                self._miss(i, "is down")
                continue
            link.outstanding += 1
            waiting[link.fileno()] = link
        deadline = started + self.deadline_s
        while waiting:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            poller = select.poll()
            for fd, link in waiting.items():
                poller.register(fd, _IN | (select.POLLOUT if link.wants_write() else 0))
            for fd, event in poller.poll(left * 1000):
                link = waiting[fd]
                if event & select.POLLOUT:
                    link.flush()
                if event & _IN:
                    self._read(link, qid, got)
                if link.sock is None or got[link.shard] is not None:
                    waiting.pop(fd, None)
        for link in waiting.values():
            self._miss(link.shard, f"did not answer within {self.deadline_s * 1000:.1f} ms")
        self.query_seconds.observe(time.perf_counter() - started)
        return got

    def _read(self, link: QueryLink, qid: int, got: list[wire.Answer | None]) -> None:
        try:
            messages = link.receive()
        except wire.WireError as exc:
            self.bad.labels(str(link.shard)).inc()
            self._ratelog.error(f"bad-{link.shard}", "index shard %d: %s", link.shard, exc)
            return
        for m in messages:
            if not isinstance(m, wire.Answer):
                continue
            link.outstanding = max(0, link.outstanding - 1)
            self.down[link.shard] = frozenset(m.down)
            self._tiered[link.shard] = m.tiered
            if m.id == qid:
                got[link.shard] = m

    def _miss(self, shard: int, why: str) -> None:
        self.missed.labels(str(shard)).inc()
        self._ratelog.warning(
            f"miss-{shard}", "index shard %d %s: its workers have no evidence", shard, why
        )

    def _one_way(self, worker: str, message: wire.ToShard) -> None:
        link = self.links[self.owner(worker)]
        if not link.send(wire.frame(message)):
            self._miss(link.shard, "is down")

    def link_up(self, shard: int) -> bool:
        return self.links[shard].ensure()

    # -- IndexView ------------------------------------------------------------------------
    def prompt_keys(
        self, token_ids: Sequence[int], lora_name: str = "", cache_salt: str = ""
    ) -> Sequence[int]:
        return content_keys(token_ids, _ns(lora_name, cache_salt), self.hash_unit)

    def _keys(
        self, token_ids: Sequence[int], lora_name: str, cache_salt: str, keys: Sequence[int] | None
    ) -> Sequence[int]:
        return keys if keys is not None else self.prompt_keys(token_ids, lora_name, cache_salt)

    def score(
        self,
        token_ids: Sequence[int],
        lora_name: str = "",
        cache_salt: str = "",
        keys: Sequence[int] | None = None,
    ) -> Mapping[str, int | None]:
        keys = self._keys(token_ids, lora_name, cache_salt, keys)
        out: dict[str, int | None] = {}
        for a in self.ask("score", keys, len(token_ids)):
            if a is not None:
                out.update(a.scores)
        return out

    def reach(
        self,
        token_ids: Sequence[int],
        lora_name: str = "",
        cache_salt: str = "",
        keys: Sequence[int] | None = None,
    ) -> tuple[Mapping[str, int | None], Mapping[str, int]]:
        keys = self._keys(token_ids, lora_name, cache_salt, keys)
        scores: dict[str, int | None] = {}
        coverage: dict[str, int] = {}
        for a in self.ask("reach", keys, len(token_ids)):
            if a is not None:
                scores.update(a.scores)
                coverage.update(a.coverage)
        return scores, coverage

    def explain(
        self,
        token_ids: Sequence[int],
        lora_name: str = "",
        cache_salt: str = "",
        keys: Sequence[int] | None = None,
    ) -> Mapping[str, ReuseExplanation]:
        keys = self._keys(token_ids, lora_name, cache_salt, keys)
        out: dict[str, ReuseExplanation] = {}
        for a in self.ask("explain", keys, len(token_ids)):
            if a is None:
                continue
            for worker, e in a.explained.items():
                out[worker] = ReuseExplanation.of(e)
        return out

    def tiers(
        self,
        token_ids: Sequence[int],
        gpu: Mapping[str, int | None],
        lora_name: str = "",
        cache_salt: str = "",
        keys: Sequence[int] | None = None,
    ) -> Mapping[str, TierReuse]:
        if not any(self._tiered):
            return {}
        keys = self._keys(token_ids, lora_name, cache_salt, keys)
        parts: list[dict[str, int | None]] = [{} for _ in self.links]
        for worker, hit in gpu.items():
            parts[self.owner(worker)][worker] = hit
        only = [self._tiered[i] and bool(parts[i]) for i in range(len(self.links))]
        out: dict[str, TierReuse] = {}
        for a in self.ask("tiers", keys, len(token_ids), gpu=parts, only=only):
            if a is not None:
                out.update((w, TierReuse(cpu, storage)) for w, (cpu, storage) in a.tiers.items())
        return out

    def expect(
        self,
        worker: str,
        token_ids: Sequence[int],
        lora_name: str,
        cache_salt: str,
        ttl_s: float,
        keys: Sequence[int] | None = None,
        junction: int = 0,
    ) -> None:
        keys = self._keys(token_ids, lora_name, cache_salt, keys)
        low, start = wire.split_keys(keys)
        self._one_way(worker, wire.Expect(worker, low, len(token_ids), ttl_s, junction, start))

    def apply(self, worker: str, batch: events_pb2.KvEventBatch) -> None:
        self._one_way(worker, wire.Apply(worker, batch.SerializeToString()))

    def apply_snapshot(self, worker: str, snapshot: events_pb2.Snapshot) -> None:
        self._one_way(worker, wire.Apply(worker, snapshot.SerializeToString(), snapshot=True))

    def apply_snapshot_steps(
        self, worker: str, snapshot: events_pb2.Snapshot, blocks_per_step: int
    ) -> Iterator[None]:
        self.apply_snapshot(worker, snapshot)  # the shard applies it off this loop
        yield from ()

    def invalidate(self, worker: str) -> None:
        self._one_way(worker, wire.Invalidate(worker))

    def remove_worker(self, worker: str) -> None:
        self._stats.pop(worker, None)
        self._one_way(worker, wire.RemoveWorker(worker))

    def set_alignment(self, worker: str, alignment: int | None) -> None:
        self._one_way(worker, wire.Alignment(worker, alignment))

    def stats(self, worker: str) -> IndexStats | None:
        """As of the shard's latest status answer (`index.status_interval_s`)."""
        return self._stats.get(worker)

    def note_stats(self, worker: str, stats: IndexStats | None) -> None:
        if stats is None:
            self._stats.pop(worker, None)
        else:
            self._stats[worker] = stats

    def close(self) -> None:
        for link in self.links:
            link.reset()
