"""Decision latency of the index in shard processes (`index.processes`) against the index in
the router process, while the shards ingest KV events.

    python -m bench.index_shard_bench                  # 256 and 1,024 workers (minutes)
    python -m bench.index_shard_bench --smoke          # seconds

For each fleet size the same content (every worker: a 2,048-token system prompt and
`--background` tokens of its own conversations in 2,048-token prefill chunks, as in
bench/index_bench.py; a follow-up request cached to 90% on two workers and to half on two
more) goes into an in-process `FleetIndexView` and, through the shard-backed view, into K
shard processes. A decision's index work is timed as the router does it: `reach` then
`tiers` with the prompt's keys already hashed (hashing is the same in both designs and
reported apart). The shard-backed view is timed while a feeder process sends every worker
fresh 128-block prefill stores and removes of older ones at `--rate` blocks per second in
all (the in-process index would apply those on the proxy's event loop: its share of a core
is reported from the measured in-process ingest rate).

`--via grpc` feeds the shards as a router's do in service: the feeder process is a bridge (a
gRPC KvEvents server whose dp_rank k is worker k) and each shard follows its workers over
their own subscriptions (`Follow`), so the fed batches reach the index through the shard's
event subscriptions rather than `Apply` frames on a socket. Then the event lag (each batch's
send time to its apply, the shards' `kvroute_event_lag_seconds`) is reported too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

from bench.index_bench import LAYOUTS, SYSTEM, UNIT, Engine, engine_hashes, tokens
from kvroute.indexer import content_keys
from kvroute.proto import events_pb2 as pb
from kvroute.router.index_shards import wire
from kvroute.router.index_shards.client import ShardedIndexView
from kvroute.router.index_shards.server import ShardSettings
from kvroute.router.index_shards.supervisor import ShardSupervisor
from kvroute.router.routing.fleet_index_view import FleetIndexView
from kvroute.testbed.procs import cpu_seconds

POOL = 64  # distinct feeder prompts per worker cycle; a store evicts the one POOL/2 before
CHUNK_TOKENS = 2048


def fleet_batches(n_workers: int, background: int, seed: int) -> dict[str, list[pb.KvEventBatch]]:
    """Each worker's batches: the shared system prompt, then its own conversations."""
    system = tokens(SYSTEM, seed)
    out: dict[str, list[pb.KvEventBatch]] = {}
    for w in range(n_workers):
        eng = Engine(LAYOUTS["full"])
        batches = eng.prompt(system)
        budget, i = background, 0
        while budget > 0:
            length = min(budget, 4096 + (w * 7919 + i * 104729) % 12288)
            batches += eng.prompt(system + tokens(length, seed + 1000 * w + i + 1), start=SYSTEM)
            budget -= length
            i += 1
        out[f"w{w}"] = batches
        out.setdefault("_engines", []).append(eng)  # type: ignore[arg-type]
    return out


def hot_prompt(
    engines: list[Engine], n_tokens: int, seed: int
) -> tuple[list[int], dict[str, list[pb.KvEventBatch]]]:
    shared = min(SYSTEM, n_tokens // 2)
    hot = tokens(SYSTEM, seed)[:shared] + tokens(n_tokens - shared, seed + n_tokens)
    n = len(engines)
    placed: dict[str, list[pb.KvEventBatch]] = {}
    for w, frac in ((0, 0.9), (n // 2, 0.9), (n // 3, 0.5), (n - 1, 0.5)):
        placed.setdefault(f"w{w}", []).extend(engines[w].prompt(hot[: int(n_tokens * frac)]))
    return hot, placed


def percentiles(samples_ms: list[float]) -> dict[str, float]:
    s = sorted(samples_ms)
    return {
        "p50_ms": round(statistics.median(s), 4),
        "p99_ms": round(s[min(len(s) - 1, int(len(s) * 0.99))], 4),
        "max_ms": round(s[-1], 4),
    }


def time_decisions(view: object, prompt: list[int], keys: list[int], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        scores, _ = view.reach(prompt, keys=keys)  # type: ignore[attr-defined]
        view.tiers(prompt, scores, keys=keys)  # type: ignore[attr-defined]
        out.append((time.perf_counter() - t0) * 1000)
        time.sleep(0.0005)  # decisions arrive spread out, not back to back
    return out


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


# -- the feeder (a separate process) -------------------------------------------------------
def feeder_pool(seed: int) -> list[tuple[pb.KvGroupEvent, list[bytes]]]:
    pool = []
    for i in range(POOL):
        toks = tokens(CHUNK_TOKENS, seed + 50_000 + i)
        hashes = engine_hashes(toks)
        store = pb.KvGroupEvent(
            operation=pb.KvGroupEvent.STORE,
            group_id=0,
            block_hashes=hashes,
            parent_block_hash=b"",
            token_ids=toks,
            block_size=UNIT,
            kind="full_attention",
        )
        pool.append((store, hashes))
    return pool


def feed(paths: list[str], rate: float, seconds: float, first_seqs: list[int]) -> None:
    """Send every worker, in turn, a batch storing one pool prompt (128 blocks) and removing
    the one stored POOL/2 turns earlier, paced to `rate` blocks (stored + removed) per
    second, each worker's batches numbered on from `first_seqs`; returns once the shards
    have applied all of it and prints the rate they applied it at (and the next sequence of
    every worker) as JSON."""
    from kvroute.router.index_shards.assign import shard_of

    socks = []
    for path in paths:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(path)
        socks.append(sock)
    pool = feeder_pool(7)
    n_workers = len(first_seqs)
    seqs = list(first_seqs)
    turn = [0] * n_workers
    blocks = 0
    started = time.perf_counter()
    w = 0
    while True:
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            break
        if blocks > rate * elapsed:
            time.sleep(0.0005)
            continue
        batch, sent = feed_batch(pool, turn[w], seqs[w])
        name = f"w{w}"
        sock = socks[shard_of(name, len(socks))]
        sock.sendall(wire.frame(wire.Apply(name, batch.SerializeToString())))
        blocks += sent
        seqs[w] += 1
        turn[w] += 1
        w = (w + 1) % n_workers
    for sock in socks:  # count only what the shards have applied: a barrier on each socket
        sock.sendall(wire.frame(wire.Query(1, "score", [], 0)))
        reader = wire.FrameReader()
        while not reader.feed(sock.recv(65536)):
            pass
        sock.close()
    elapsed = time.perf_counter() - started
    print(
        json.dumps({"blocks": blocks, "seconds": elapsed, "rate": blocks / elapsed, "seqs": seqs})
    )


def feed_batch(
    pool: list[tuple[pb.KvGroupEvent, list[bytes]]], turn: int, seq: int
) -> tuple[pb.KvEventBatch, int]:
    """Turn `turn` of a worker's feed: store pool prompt turn % POOL, remove the one stored
    POOL/2 turns earlier; the batch and the blocks it stores and removes."""
    batch = pb.KvEventBatch(sequence=seq, timestamp=time.time())
    store, _ = pool[turn % POOL]
    batch.events.append(store)
    sent = len(store.block_hashes)
    if turn >= POOL // 2:
        _, old = pool[(turn - POOL // 2) % POOL]
        batch.events.append(pb.KvGroupEvent(operation=pb.KvGroupEvent.REMOVE, block_hashes=old))
        sent += len(old)
    return batch, sent


class _Rank:
    """Worker k's stream on the feeder's bridge (the face `kv_events_handler` uses): an empty
    snapshot without a sequence when subscribed, then whatever the feed offers."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.subscriber: object | None = None
        self.epoch = 0

    def subscribe(self, request: pb.SubscribeRequest) -> object:
        from kvroute.bridge.stream import Subscriber

        self.epoch += 1
        sub = Subscriber(1 << 16)
        snap = pb.Snapshot(
            dp_rank=self.k, stream_id=f"bench/{self.k}/{self.epoch}", reason="initial"
        )
        sub.offer(pb.SubscribeResponse(snapshot=snap).SerializeToString())
        self.subscriber = sub
        return sub

    def unsubscribe(self, subscriber: object) -> None:
        if subscriber is self.subscriber:
            self.subscriber = None


async def serve_grpc(n_workers: int) -> None:
    """Be the workers' bridge: print "PORT n" once serving, then for each line read from
    stdin ({"rate", "seconds", "first_seqs"}) feed as `feed` does, through the subscriptions,
    and print the JSON `feed` prints once it is all queued (the caller waits for the shards
    to apply it)."""
    from kvroute.bridge.server import kv_events_handler, start_grpc_server
    from kvroute.bridge.stream import RankStream

    ranks = [_Rank(k) for k in range(n_workers)]
    handler = kv_events_handler(
        lambda k: cast(RankStream, ranks[k]) if 0 <= k < n_workers else None  # duck-typed
    )
    server, port = await start_grpc_server("127.0.0.1:0", handler)  # type: ignore[arg-type]
    print(f"PORT {port}", flush=True)
    pool = feeder_pool(7)
    loop = asyncio.get_running_loop()
    turn = [0] * n_workers
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            ask = json.loads(line)
            rate, seconds, seqs = ask["rate"], ask["seconds"], list(ask["first_seqs"])
            blocks = overflows = 0
            started = time.perf_counter()
            w = 0
            while (elapsed := time.perf_counter() - started) < seconds:
                if blocks > rate * elapsed:
                    await asyncio.sleep(0.0005)
                    continue
                batch, sent = feed_batch(pool, turn[w], seqs[w])
                sub = ranks[w].subscriber
                message = pb.SubscribeResponse(batch=batch).SerializeToString()
                if sub is None or not sub.offer(message):  # type: ignore[attr-defined]
                    overflows += 1
                blocks += sent
                seqs[w] += 1
                turn[w] += 1
                w = (w + 1) % n_workers
                if w % 16 == 0:
                    await asyncio.sleep(0)  # let the handlers send
            out = {"blocks": blocks, "seconds": time.perf_counter() - started, "seqs": seqs}
            print(json.dumps({**out, "overflows": overflows}), flush=True)
    finally:
        await server.stop(grace=None)


class Control:
    """The bench's control connection to one shard: which workers it follows, its status."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(path)
        self._reader = wire.FrameReader()
        self._asked = 0

    def follow(self, refs: list[wire.WorkerRef]) -> None:
        self.sock.sendall(wire.frame(wire.Follow(refs)))

    def status(self) -> wire.StatusAnswer:
        self._asked += 1
        self.sock.sendall(wire.frame(wire.StatusAsk(self._asked)))
        while True:
            for body in self._reader.feed(self.sock.recv(1 << 20)):
                answer = wire.decode_from_shard(body)
                if isinstance(answer, wire.StatusAnswer) and answer.id == self._asked:
                    return answer

    def close(self) -> None:
        self.sock.close()


def lag_counts(controls: list[Control]) -> list[float]:
    """The shards' kvroute_event_lag_seconds bucket counts (+Inf last), summed."""
    total: list[float] = []
    for c in controls:
        for s in c.status().series:
            if s.family == "kvroute_event_lag_seconds":
                counts = s.values[:-1]
                total = [a + b for a, b in zip(total, counts, strict=True)] if total else counts
    return total


def bucket_quantile(counts: list[float], q: float) -> float | None:
    """Quantile q of a histogram's bucket counts (the lag buckets), interpolated within its
    bucket as Prometheus does; None without observations, inf past the last bound."""
    from kvroute.router.ops.metrics import _LAG

    n = sum(counts)
    if n <= 0:
        return None
    rank, seen, lower = q * n, 0.0, 0.0
    for bound, c in zip([*_LAG, float("inf")], counts, strict=True):
        if seen + c >= rank and c > 0:
            if bound == float("inf"):
                return bound
            return lower + (bound - lower) * (rank - seen) / c
        seen += c
        lower = bound
    return float("inf")


def ingest_rate_in_process(seed: int) -> float:
    """Blocks (stored + removed) per second the in-process index applies the feeder's batches."""
    view = FleetIndexView()
    pool = feeder_pool(seed)
    batches = []
    for t in range(POOL * 2):
        batch = pb.KvEventBatch(sequence=t)
        batch.events.append(pool[t % POOL][0])
        n = len(pool[t % POOL][1])
        if t >= POOL // 2:
            old = pool[(t - POOL // 2) % POOL][1]
            batch.events.append(pb.KvGroupEvent(operation=pb.KvGroupEvent.REMOVE, block_hashes=old))
            n += len(old)
        batches.append((batch.SerializeToString(), n))
    blocks = 0
    t0 = time.perf_counter()
    for data, n in batches:  # as the router does it: decode, then apply
        view.apply("w", pb.KvEventBatch.FromString(data))
        blocks += n
    return blocks / (time.perf_counter() - t0)


def load(paths: list[str], content: dict[str, list[pb.KvEventBatch]]) -> None:
    """Apply every batch in the shards, over blocking sockets (the shard's reading paces the
    sending), and return once each shard has applied all of it."""
    from kvroute.router.index_shards.assign import shard_of

    socks = []
    for path in paths:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(path)
        socks.append(sock)
    for w, batches in content.items():
        sock = socks[shard_of(w, len(paths))]
        for b in batches:
            sock.sendall(wire.frame(wire.Apply(w, b.SerializeToString())))
    for sock in socks:  # answered after everything sent before it: a barrier
        sock.sendall(wire.frame(wire.Query(1, "score", [], 0)))
        reader = wire.FrameReader()
        while not reader.feed(sock.recv(65536)):
            pass
        sock.close()


# -- the run -------------------------------------------------------------------------------
class GrpcFeeder:
    """The feeder process of `--via grpc`: the workers' bridge, fed on request."""

    def __init__(self, n_workers: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.index_shard_bench", "--serve-grpc", str(n_workers)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"the gRPC feeder did not start: {line!r}")
        self.address = f"127.0.0.1:{int(line.split()[1])}"

    def start(self, rate: float, seconds: float, first_seqs: list[int]) -> None:
        assert self.proc.stdin is not None
        ask = {"rate": rate, "seconds": seconds, "first_seqs": first_seqs}
        self.proc.stdin.write(json.dumps(ask) + "\n")
        self.proc.stdin.flush()

    def done(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        return dict(json.loads(self.proc.stdout.readline()))

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def follow_over_grpc(
    controls: list[Control], feeder: GrpcFeeder, n_workers: int, timeout_s: float = 120.0
) -> float:
    """Have each shard follow its workers on the feeder's bridge; the seconds until every
    stream is live (its empty snapshot applied)."""
    from kvroute.router.index_shards.assign import shard_of

    t0 = time.perf_counter()
    refs: list[list[wire.WorkerRef]] = [[] for _ in controls]
    for k in range(n_workers):
        name = f"w{k}"
        refs[shard_of(name, len(controls))].append(
            wire.WorkerRef(name, bridge=feeder.address, dp_rank=k)
        )
    for c, mine in zip(controls, refs, strict=True):
        c.follow(mine)
    while True:
        live = sum(1 for c in controls for w in c.status().workers if w.state == "live")
        if live == n_workers:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout_s:
            raise RuntimeError(f"{live} of {n_workers} streams live after {timeout_s} s")
        time.sleep(0.2)


def applied_through(controls: list[Control], seqs: list[int], timeout_s: float = 300.0) -> float:
    """Wait until every worker's index holds its batches up to sequence seqs[k] - 1; the
    seconds waited."""
    t0 = time.perf_counter()
    want = {f"w{k}": s - 1 for k, s in enumerate(seqs)}
    while True:
        behind = 0
        for c in controls:
            for w in c.status().workers:
                if w.name in want and (w.index_sequence or -1) < want[w.name]:
                    behind += 1
        if not behind:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout_s:
            raise RuntimeError(f"{behind} workers not caught up after {timeout_s} s")
        time.sleep(0.05)


def run_fleet(
    n_workers: int,
    shards: int,
    background: int,
    prompt_sizes: list[int],
    reps: int,
    rate: float,
    via: str = "apply",
) -> dict[str, object]:
    t0 = time.perf_counter()
    content = fleet_batches(n_workers, background, seed=1)
    engines: list[Engine] = content.pop("_engines")  # type: ignore[assignment]
    prompts = {}
    for n in prompt_sizes:
        hot, placed = hot_prompt(engines, n, seed=1)
        prompts[n] = hot
        for w, batches in placed.items():
            content[w] += batches
    blocks = sum(e.stored_blocks for e in engines)
    print(f"workers={n_workers}: {blocks:,} blocks built in {time.perf_counter() - t0:.1f} s")
    local = FleetIndexView()
    for w, batches in content.items():
        for b in batches:
            local.apply(w, b)
    sup = ShardSupervisor(shards, ShardSettings())
    sup.start()
    feeder: GrpcFeeder | None = None
    controls: list[Control] = []
    try:
        paths = [sup.socket(i) for i in range(shards)]
        remote = ShardedIndexView(paths, deadline_s=120.0)
        while not all(link.ensure() for link in remote.links):
            time.sleep(0.05)
        live_s = None
        if via == "grpc":
            feeder = GrpcFeeder(n_workers)
            controls = [Control(p) for p in paths]
            live_s = follow_over_grpc(controls, feeder, n_workers)
            print(f"  {n_workers} subscriptions live in {live_s:.1f} s")
        t1 = time.perf_counter()
        load(paths, content)
        load_s = time.perf_counter() - t1
        print(f"  shards loaded in {load_s:.1f} s")
        rows = []
        for n in prompt_sizes:
            hot = prompts[n]
            keys = content_keys(hot)
            want = local.reach(hot, keys=keys)
            remote.deadline_s = 120.0
            assert remote.reach(hot, keys=keys) == want, "shards disagree with the in-process index"
            best = max(v or 0 for v in want[0].values())
            hashing = [0.0] * 0
            for _ in range(min(reps, 50)):
                h0 = time.perf_counter()
                content_keys(hot)
                hashing.append((time.perf_counter() - h0) * 1000)
            in_proc = time_decisions(local, hot, keys, reps)
            remote.deadline_s = 0.01  # the default index.deadline_s
            pids = [pid for i in range(shards) if (pid := sup.pid(i)) is not None]
            shard_cpu0, cpu0 = sum(cpu_seconds(p) for p in pids), time.process_time()
            idle = time_decisions(remote, hot, keys, reps)
            router_cpu = (time.process_time() - cpu0) / reps * 1000
            shard_cpu = (sum(cpu_seconds(p) for p in pids) - shard_cpu0) / reps * 1000
            missed_before = sum(remote.missed.labels(str(i))._value.get() for i in range(shards))
            seconds = max(5.0, reps * 0.004 + 3.0)
            first_seqs = [e.seq for e in engines]
            lag0 = lag_counts(controls) if controls else []
            feed_cpu0, feed_t0 = sum(cpu_seconds(p) for p in pids), time.perf_counter()
            if feeder is not None:
                feeder.start(rate, seconds, first_seqs)
            else:
                proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "bench.index_shard_bench",
                        "--feed",
                        json.dumps(paths),
                        "--rate",
                        str(rate),
                        "--seconds",
                        str(seconds),
                        "--first-seqs",
                        json.dumps(first_seqs),
                    ],
                    stdout=subprocess.PIPE,
                )
            time.sleep(1.0)  # the feed is under way
            busy = time_decisions(remote, hot, keys, reps)
            overflows = 0
            if feeder is not None:
                fed = feeder.done()
                applied_through(controls, fed["seqs"])
                fed["rate"] = fed["blocks"] / (time.perf_counter() - feed_t0)
                overflows = int(fed["overflows"])
            else:
                out, _ = proc.communicate()
                fed = json.loads(out.decode().strip().splitlines()[-1])
            feed_wall = time.perf_counter() - feed_t0
            feed_cpu = sum(cpu_seconds(p) for p in pids) - feed_cpu0
            lag = [b - a for a, b in zip(lag0, lag_counts(controls), strict=True)] if lag0 else []
            for eng, seq in zip(engines, fed["seqs"], strict=True):
                eng.seq = seq
            remote.deadline_s = 120.0  # the fed stores and removes left the request's hits
            assert remote.reach(hot, keys=keys) == want, "the feed changed the answer"
            missed = sum(remote.missed.labels(str(i))._value.get() for i in range(shards))
            row = {
                "workers": n_workers,
                "shards": shards,
                "via": via,
                "prompt_tokens": n,
                "best_hit": best,
                "hash_ms": percentiles(hashing),
                "in_process": percentiles(in_proc),
                "shards_idle": percentiles(idle),
                "router_cpu_ms_per_decision": round(router_cpu, 3),
                "shards_cpu_ms_per_decision": round(shard_cpu, 3),
                "shards_ingesting": percentiles(busy),
                "feed_blocks_per_s": round(fed["rate"]),
                "shards_cpu_s_per_s_ingesting": round(feed_cpu / feed_wall, 3),
                "missed_while_ingesting": int(missed - missed_before),
                "decisions": reps,
            }
            if lag:
                p50, p99 = bucket_quantile(lag, 0.5), bucket_quantile(lag, 0.99)
                row["lag_ms"] = {
                    "p50_ms": None if p50 is None else round(p50 * 1000, 2),
                    "p99_ms": None if p99 is None else round(p99 * 1000, 2),
                    "batches": int(sum(lag)),
                }
                row["feed_overflows"] = overflows
            rows.append(row)
            lag_text = (
                f" lag p50={row['lag_ms']['p50_ms']} p99={row['lag_ms']['p99_ms']} ms"  # type: ignore[index]
                if "lag_ms" in row
                else ""
            )
            print(
                f"  tokens={n}: in-process p50={row['in_process']['p50_ms']} "
                f"p99={row['in_process']['p99_ms']} | shards idle p50="
                f"{row['shards_idle']['p50_ms']} p99={row['shards_idle']['p99_ms']} | ingesting "
                f"{row['feed_blocks_per_s']:,} blocks/s p50={row['shards_ingesting']['p50_ms']} "
                f"p99={row['shards_ingesting']['p99_ms']} missed={row['missed_while_ingesting']}"
                f" shards CPU {row['shards_cpu_s_per_s_ingesting']} s/s{lag_text}",
                flush=True,
            )
        rss = [rss_mb(pid) for i in range(shards) if (pid := sup.pid(i)) is not None]
        remote.close()
        return {
            "workers": n_workers,
            "via": via,
            "blocks": blocks,
            "subscriptions_live_s": None if live_s is None else round(live_s, 2),
            "shard_load_s": round(load_s, 2),
            "shard_rss_mb": rss,
            "bench_rss_mb": rss_mb(os.getpid()),
            "rows": rows,
        }
    finally:
        for c in controls:
            c.close()
        sup.stop()
        if feeder is not None:
            feeder.stop()


def markdown(result: dict[str, object]) -> str:
    lines = [
        "| workers | shards | fed via | prompt tokens | in-process p50 / p99 | "
        "shards idle p50 / p99 | shards ingesting p50 / p99 | feed blocks/s | missed | "
        "lag p50 / p99 ms | shards CPU-s/s ingesting | hashing p50 | "
        "CPU per decision: router / all shards |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for fleet in result["fleets"]:  # type: ignore[attr-defined]
        for r in fleet["rows"]:
            lag = r.get("lag_ms")
            lag_cell = f"{lag['p50_ms']} / {lag['p99_ms']}" if lag else "-"
            lines.append(
                f"| {r['workers']} | {r['shards']} | {r.get('via', 'apply')} | "
                f"{r['prompt_tokens']} | "
                f"{r['in_process']['p50_ms']:.3f} / {r['in_process']['p99_ms']:.3f} | "
                f"{r['shards_idle']['p50_ms']:.3f} / {r['shards_idle']['p99_ms']:.3f} | "
                f"{r['shards_ingesting']['p50_ms']:.3f} / {r['shards_ingesting']['p99_ms']:.3f} | "
                f"{r['feed_blocks_per_s']:,} | {r['missed_while_ingesting']} | {lag_cell} | "
                f"{r.get('shards_cpu_s_per_s_ingesting', '-')} | {r['hash_ms']['p50_ms']:.3f} | "
                f"{r['router_cpu_ms_per_decision']:.3f} / "
                f"{r['shards_cpu_ms_per_decision']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="small fleets, few decisions")
    p.add_argument("--shards", type=int, default=2, help="shard processes (default 2)")
    p.add_argument("--workers", type=int, nargs="*", help="fleet sizes (default 256 1024)")
    p.add_argument("--background", type=int, default=32768, help="own tokens per worker")
    p.add_argument("--rate", type=float, default=100_000, help="blocks/s fed while timing")
    p.add_argument("--reps", type=int, default=400, help="decisions timed per case")
    p.add_argument("--out", type=Path, help="directory for index_shards.json and .md")
    p.add_argument(
        "--via",
        choices=("apply", "grpc"),
        default="apply",
        help="feed the shards Apply frames on a socket, or over the workers' gRPC subscriptions",
    )
    p.add_argument("--prompts", type=int, nargs="*", help="prompt sizes (default 8192 32768)")
    p.add_argument("--serve-grpc", type=int, help=argparse.SUPPRESS)  # be the gRPC feeder
    p.add_argument("--feed", help=argparse.SUPPRESS)  # JSON list of sockets: be the feeder
    p.add_argument("--seconds", type=float, default=5.0, help=argparse.SUPPRESS)
    p.add_argument("--first-seqs", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_grpc:
        asyncio.run(serve_grpc(args.serve_grpc))
        return 0
    if args.feed:
        feed(json.loads(args.feed), args.rate, args.seconds, json.loads(args.first_seqs))
        return 0
    fleets = args.workers or ([16, 64] if args.smoke else [256, 1024])
    prompts = args.prompts or ([8192, 32768] if not args.smoke else [8192])
    reps = 60 if args.smoke else args.reps
    background = 4096 if args.smoke else args.background
    rate = min(args.rate, 20_000) if args.smoke else args.rate
    result: dict[str, object] = {
        "command": "python -m bench.index_shard_bench " + " ".join(argv or sys.argv[1:]),
        "machine": f"{platform.machine()} x{os.cpu_count()}",
        "python": platform.python_version(),
        "load_before": os.getloadavg(),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "in_process_ingest_blocks_per_s": round(ingest_rate_in_process(7)),
        "fleets": [
            run_fleet(n, args.shards, background, prompts, reps, rate, args.via) for n in fleets
        ],
        "load_after": os.getloadavg(),
    }
    print(markdown(result))
    print(f"in-process ingest: {result['in_process_ingest_blocks_per_s']:,} blocks/s per core")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "index_shards.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "index_shards.md").write_text(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
