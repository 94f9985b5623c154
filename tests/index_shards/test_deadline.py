"""The shard-backed view's deadline: a shard that does not answer in time gives its workers
no evidence for that decision (never an error), is counted and logged, and is not asked
again while it is `MAX_OUTSTANDING` answers behind; its late answers are dropped."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvroute.indexer import content_keys
from kvroute.router.index_shards import wire
from kvroute.router.index_shards.client import MAX_OUTSTANDING, ShardedIndexView
from tests.index_shards.test_serve_process import until


class FakeShard:
    """A Unix socket that answers each query with `score` for `worker`, unless `silent`
    (then the queries are only counted until `release()` answers them all, late)."""

    def __init__(self, path: str, worker: str) -> None:
        self.worker = worker
        self.silent = False
        self.received: list[wire.Query] = []
        self.held: list[wire.Query] = []
        self.one_way: list[wire.ToShard] = []
        self._server = socket.socket(socket.AF_UNIX)
        self._server.bind(path)
        self._server.listen()
        self._conn: socket.socket | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self._server.accept()
        self._conn = conn
        reader = wire.FrameReader()
        while data := _recv(conn):
            for body in reader.feed(data):
                q = wire.decode_to_shard(body)
                if not isinstance(q, wire.Query):
                    self.one_way.append(q)
                    continue
                with self._lock:
                    self.received.append(q)
                    if self.silent:
                        self.held.append(q)
                    else:
                        conn.sendall(wire.frame(self.answer(q)))

    def close(self) -> None:
        """Gone as a killed shard is: the socket file stays, nothing listens on it."""
        self._server.close()
        if self._conn is not None:
            self._conn.shutdown(socket.SHUT_RDWR)
            self._conn.close()

    def answer(self, q: wire.Query) -> wire.Answer:
        return wire.Answer(q.id, scores={self.worker: 7 * len(q.keys)})

    def release(self) -> None:
        with self._lock:
            assert self._conn is not None
            for q in self.held:
                self._conn.sendall(wire.frame(self.answer(q)))
            self.held.clear()
            self.silent = False


def _recv(conn: socket.socket) -> bytes:
    try:
        return conn.recv(65536)
    except OSError:  # the view closed the connection
        return b""


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[ShardedIndexView, FakeShard, FakeShard]]:
    paths = [str(tmp_path / "a.sock"), str(tmp_path / "b.sock")]
    a, b = FakeShard(paths[0], "wa"), FakeShard(paths[1], "wb")
    view = ShardedIndexView(paths, deadline_s=0.05, registry=CollectorRegistry())
    yield view, a, b
    view.close()


def missed(view: ShardedIndexView, shard: int) -> float:
    return float(view.missed.labels(str(shard))._value.get())


PROMPT = list(range(64))
KEYS = content_keys(PROMPT)


def test_both_shards_answer_and_are_merged(
    pair: tuple[ShardedIndexView, FakeShard, FakeShard],
) -> None:
    view, a, _ = pair
    assert view.score(PROMPT) == {"wa": 28, "wb": 28}
    assert [q.keys for q in a.received] == [[k & (2**64 - 1) for k in KEYS]]
    assert a.received[0].start == 1 and a.received[0].n_tokens == 64
    assert missed(view, 0) == missed(view, 1) == 0


def test_a_silent_shard_costs_the_deadline_and_its_workers_evidence(
    pair: tuple[ShardedIndexView, FakeShard, FakeShard],
) -> None:
    view, _, b = pair
    view.score(PROMPT)  # both connected
    b.silent = True
    started = time.perf_counter()
    assert view.score(PROMPT) == {"wa": 28}
    took = time.perf_counter() - started
    assert 0.045 <= took < 0.5
    assert missed(view, 1) == 1 and missed(view, 0) == 0
    # at the bound of unanswered queries the shard is skipped without waiting
    for _ in range(MAX_OUTSTANDING - 1):
        assert view.score(PROMPT) == {"wa": 28}
    asked = len(b.received)
    started = time.perf_counter()
    assert view.score(PROMPT) == {"wa": 28}
    assert time.perf_counter() - started < 0.045
    assert len(b.received) == asked  # not sent: nothing queues without bound
    assert missed(view, 1) == MAX_OUTSTANDING + 1
    # the late answers arrive: dropped, and the shard is asked (and answers) again
    b.release()
    time.sleep(0.05)
    assert view.score(PROMPT) == {"wa": 28, "wb": 28}


def test_a_shard_that_is_not_there_is_no_evidence(tmp_path: Path) -> None:
    view = ShardedIndexView(
        [str(tmp_path / "none.sock")], deadline_s=0.05, registry=CollectorRegistry()
    )
    assert view.score(PROMPT) == {}
    assert view.reach(PROMPT) == ({}, {})
    view.expect("w", PROMPT, "", "", 1.0)  # one-way: dropped, counted
    assert missed(view, 0) == 3


def test_a_restarted_shard_answers_the_first_query_after_it(tmp_path: Path) -> None:
    """The view's connection to the old process is dead; the first query finds that out
    on sending and goes to the new process at once: no decision without that shard."""
    path = str(tmp_path / "a.sock")
    old = FakeShard(path, "wa")
    view = ShardedIndexView([path], deadline_s=0.5, registry=CollectorRegistry())
    assert view.score(PROMPT) == {"wa": 28}
    old.close()
    Path(path).unlink()
    new = FakeShard(path, "wa2")
    time.sleep(0.05)  # the old connection's end has reached the view's socket
    assert view.score(PROMPT) == {"wa2": 28}
    view.expect("wa2", PROMPT, "", "", 1.0)  # one-way: sent, not dropped
    assert missed(view, 0) == 0
    assert view.links[0].connects == 2
    until(lambda: len(new.one_way) == 1, 5.0)
    view.close()
    assert len(new.received) == 1 and isinstance(new.one_way[0], wire.Expect)
