"""Where a shard's query waits while the shard ingests: traced inside the shard processes.

    python -m bench.index_shard_probe --workers 1024 --rate 100000 --out DIR
    python -m bench.index_shard_probe --analyse TRACE_DIR   # traces of bench/shard_trace

Runs the fleet of `bench.index_shard_bench` (same content, same gRPC feed through the shards'
own event subscriptions) in K shard processes that record, on the host's monotonic clock,
the start and end of every batch they apply and of every query they answer. The bench side
records when it sent each query (`reach` and `tiers` of an 8K-token decision, as the router
asks them). Per query:
- wait: from its send to the shard starting to answer it;
- ahead: the batches the shard applied in that interval, and the time they took.
A query that waits behind ingest shows its wait filled by applies; one that waits for a core
(the shard not scheduled) shows a wait with no applies in it.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.index_bench import Engine
from bench.index_shard_bench import (
    Control,
    GrpcFeeder,
    applied_through,
    fleet_batches,
    follow_over_grpc,
    hot_prompt,
    load,
)
from kvroute.indexer import content_keys
from kvroute.router.index_shards import wire
from kvroute.router.index_shards.client import ShardedIndexView
from kvroute.router.index_shards.server import SETTINGS_ENV, ShardSettings

TRACE_ENV = "KVROUTE_SHARD_PROBE_TRACE"


def child(argv: list[str]) -> int:
    """A shard process whose applies and queries are traced to the file in TRACE_ENV."""
    from kvroute.router.index_shards import server
    from kvroute.router.routing.fleet_index_view import FleetIndexView

    applies: list[tuple[float, float]] = []
    queries: list[tuple[int, float, float]] = []
    apply, query = FleetIndexView.apply, server.Shard.query

    def traced_apply(self: FleetIndexView, worker: str, batch: object) -> None:
        t0 = time.monotonic()
        apply(self, worker, batch)  # type: ignore[arg-type]
        applies.append((t0, time.monotonic()))

    def traced_query(self: server.Shard, q: wire.Query) -> wire.Answer:
        t0 = time.monotonic()
        answer = query(self, q)
        queries.append((q.id, t0, time.monotonic()))
        return answer

    def dump(*_: object) -> None:
        Path(os.environ[TRACE_ENV]).write_text(json.dumps({"a": applies, "q": queries}))
        os._exit(0)

    FleetIndexView.apply = traced_apply  # type: ignore[method-assign]
    server.Shard.query = traced_query  # type: ignore[method-assign]
    signal.signal(signal.SIGTERM, dump)
    return server.main(argv)


def start_shards(directory: str, k: int) -> list[tuple[subprocess.Popen[bytes], str, str]]:
    out = []
    for i in range(k):
        path, trace = f"{directory}/shard-{i}.sock", f"{directory}/trace-{i}.json"
        env = {**os.environ, SETTINGS_ENV: ShardSettings().to_json(), TRACE_ENV: trace}
        cmd = [sys.executable, "-m", "bench.index_shard_probe", "--child", "--socket", path]
        cmd += ["--shard", str(i), "--parent", str(os.getpid())]
        out.append((subprocess.Popen(cmd, env=env), path, trace))
    for _, path, _ in out:
        while not os.path.exists(path):
            time.sleep(0.05)
    return out


def pct(values: list[float] | list[int], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q))] if s else 0.0


def analyse(
    sent: list[float], shard_traces: list[dict[str, list[list[float]]]], until: float | None = None
) -> dict[str, object]:
    """Per query a shard answered (before `until`, where the senders' trace ends): its wait,
    from the latest query send at or before the shard started answering, and the applies
    the shard did inside that wait."""
    sent = sorted(sent)
    waits, ahead_n, ahead_ms, share = [], [], [], []
    for tr in shard_traces:
        applies = sorted(tr["a"])
        starts = [a[0] for a in applies]
        for q in tr["q"]:
            t0 = q[-2]
            if until is not None and t0 > until:
                continue  # sent after the senders' last trace dump: its send is unknown
            j = bisect.bisect_right(sent, t0) - 1
            if j < 0:
                continue
            s = sent[j]
            wait = t0 - s
            i = bisect.bisect_left(starts, s)
            n, busy = 0, 0.0
            while i < len(applies) and applies[i][0] < t0:
                n += 1
                busy += min(applies[i][1], t0) - applies[i][0]
                i += 1
            waits.append(wait * 1000)
            ahead_n.append(n)
            ahead_ms.append(busy * 1000)
            share.append(busy / wait if wait > 0 else 0.0)
    return {
        "answers": len(waits),
        "wait_ms": {"p50": pct(waits, 0.5), "p90": pct(waits, 0.9), "p99": pct(waits, 0.99)},
        "batches_ahead": {
            "p50": pct(ahead_n, 0.5),
            "p90": pct(ahead_n, 0.9),
            "p99": pct(ahead_n, 0.99),
            "max": max(ahead_n, default=0),
        },
        "apply_ms_ahead": {
            "p50": pct(ahead_ms, 0.5),
            "p90": pct(ahead_ms, 0.9),
            "p99": pct(ahead_ms, 0.99),
        },
        "answers_waiting_over_2ms": sum(1 for w in waits if w > 2),
        "of_those_mostly_applying": sum(
            1 for w, f in zip(waits, share, strict=True) if w > 2 and f >= 0.5
        ),
        "mean_share_of_wait_applying": round(statistics.fmean(share), 3) if share else 0.0,
    }


def analyse_dir(directory: Path, deadline_s: float = 0.01) -> dict[str, object]:
    """`analyse` over the traces `bench/shard_trace` wrote into `directory`, with the
    router's asks that took the deadline, and how long each process waited for a CPU."""
    routers = [json.loads(f.read_text()) for f in sorted(directory.glob("router-*.json"))]
    asks = [q for r in routers for q in r["q"]]
    shards = [json.loads(f.read_text()) for f in sorted(directory.glob("shard-*.json"))]
    waited = {}
    for role, traces in (("router", routers), ("shard", shards)):
        for i, t in enumerate(traces):
            if "schedstat" in t:
                (cpu0, run0, n0), (cpu1, run1, n1) = (x[:3] for x in t["schedstat"])
                waited[f"{role}{i}"] = {
                    "cpu_s": round((cpu1 - cpu0) / 1e9, 2),
                    "runnable_not_running_s": round((run1 - run0) / 1e9, 2),
                    "mean_wait_per_timeslice_ms": round((run1 - run0) / 1e6 / max(1, n1 - n0), 3),
                }
    return {
        "traced": str(directory.name),
        "queries_sent": len(asks),
        "asks_at_deadline": sum(1 for a in asks if a[1] - a[0] >= deadline_s),
        "ask_ms": {
            "p50": pct([(a[1] - a[0]) * 1000 for a in asks], 0.5),
            "p99": pct([(a[1] - a[0]) * 1000 for a in asks], 0.99),
        },
        "cpu_wait": waited,
        **analyse([a[0] for a in asks], shards, max((a[1] for a in asks), default=None)),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return child(argv[1:])
    if argv and argv[0] == "--analyse":
        print(json.dumps(analyse_dir(Path(argv[1])), indent=2))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=1024)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--background", type=int, default=32768)
    p.add_argument("--rate", type=float, default=100_000)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    content = fleet_batches(args.workers, args.background, seed=1)
    engines: list[Engine] = content.pop("_engines")  # type: ignore[assignment]
    hot, placed = hot_prompt(engines, args.tokens, seed=1)
    for w, batches in placed.items():
        content[w] += batches
    keys = content_keys(hot)
    directory = tempfile.mkdtemp(prefix="kvroute-probe-")
    shards = start_shards(directory, args.shards)
    paths = [path for _, path, _ in shards]
    feeder = GrpcFeeder(args.workers)
    controls = [Control(path) for path in paths]
    load_before = os.getloadavg()
    try:
        follow_over_grpc(controls, feeder, args.workers)
        load(paths, content)
        view = ShardedIndexView(paths, deadline_s=0.01)
        sent: dict[int, float] = {}
        ask = view.ask

        def traced_ask(*a: Any, **kw: Any) -> Any:
            sent[view._next_id + 1] = time.monotonic()
            return ask(*a, **kw)

        view.ask = traced_ask  # type: ignore[method-assign,assignment]
        feeder.start(args.rate, args.reps * 0.004 + 3.0, [e.seq for e in engines])
        time.sleep(1.0)
        for _ in range(args.reps):
            scores, _ = view.reach(hot, keys=keys)
            view.tiers(hot, scores, keys=keys)
            time.sleep(0.0005)
        fed = feeder.done()
        applied_through(controls, fed["seqs"])
        missed = sum(view.missed.labels(str(i))._value.get() for i in range(args.shards))
    finally:
        for c in controls:
            c.close()
        for proc, _, _ in shards:
            proc.terminate()
        for proc, _, _ in shards:
            proc.wait(30)
        feeder.stop()
    traces = [json.loads(Path(trace).read_text()) for _, _, trace in shards]
    traces = [{"a": t["a"], "q": [[q[1], q[2]] for q in t["q"]]} for t in traces]
    result = {
        "command": "python -m bench.index_shard_probe " + " ".join(argv),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "missed": int(missed),
        **analyse(list(sent.values()), traces),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
