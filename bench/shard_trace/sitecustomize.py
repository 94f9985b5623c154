"""Traces, for `bench.index_shard_probe --analyse`, where an index shard's queries wait inside
any run (e.g. `bench.fleet_scale_bench`): with this directory on PYTHONPATH and
KVROUTE_SHARD_TRACE_DIR set, every index shard process records the start and end of each
batch it applies and each query it answers, and every router process the start and end of
each query it sends the shards (the host's monotonic clock), and its /proc/self/schedstat
(CPU time, time waiting for a CPU while runnable, timeslices) at start and at each dump, into
$KVROUTE_SHARD_TRACE_DIR/<role>-<pid>.json every 5 s. Without the variable it does nothing.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

_DIR = os.environ.get("KVROUTE_SHARD_TRACE_DIR")


def _install() -> None:
    assert _DIR is not None
    role = ""
    if "--shard" in sys.argv and "--socket" in sys.argv:
        role = "shard"
    elif "serve" in sys.argv:
        role = "router"
    if not role:
        return
    trace: dict[str, list[tuple[float, float]]] = {"a": [], "q": []}

    def timed(cls: type, name: str, key: str) -> None:
        inner = getattr(cls, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            t0 = time.monotonic()
            try:
                return inner(*args, **kwargs)
            finally:
                trace[key].append((t0, time.monotonic()))

        setattr(cls, name, wrapper)

    if role == "shard":
        from kvroute.router.routing.fleet_index_view import FleetIndexView

        timed(FleetIndexView, "apply", "a")
        timed(FleetIndexView, "reach", "q")
        timed(FleetIndexView, "score", "q")
    else:
        from kvroute.router.index_shards.client import ShardedIndexView

        timed(ShardedIndexView, "ask", "q")
    path = os.path.join(_DIR, f"{role}-{os.getpid()}.json")

    def schedstat() -> list[int]:
        with open("/proc/self/schedstat") as f:
            return [int(x) for x in f.read().split()]

    sched0 = schedstat()

    def dump() -> None:
        while True:
            time.sleep(5.0)
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                out: dict[str, object] = {k: list(v) for k, v in trace.items()}
                out["schedstat"] = [sched0, schedstat()]
                json.dump(out, f)
            os.replace(tmp, path)

    threading.Thread(target=dump, daemon=True).start()


if _DIR:
    try:
        _install()
    except Exception as exc:  # a tracer must never stop the process it traces
        print(f"shard trace: not installed: {exc!r}", file=sys.stderr)
