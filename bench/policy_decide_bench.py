"""Time of one policy decision (`Policy.decide`: candidates, cost terms, pick), alone.

    PYTHONPATH=. python bench/policy_decide_bench.py [--repeat N]

Replays the recorded decision inputs of `tests/routing/fixtures/decisions.json.gz` (4
workers; the fleet's state is set before each decision, outside the timed part), and decides
on a synthetic 64-worker fleet with reuse everywhere. Prints the median and p99 in
microseconds per decision for each.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from kvroute.router.config import PolicyConfig
from kvroute.router.fleet.load import EngineMetrics
from tests.routing.decision_replay import Replayer, read_fixture


def _stats(times: list[float]) -> str:
    times.sort()
    med = statistics.median(times) * 1e6
    p99 = times[int(0.99 * (len(times) - 1))] * 1e6
    return f"median {med:7.2f} us  p99 {p99:7.2f} us  ({len(times)} decisions)"


def fixture_runs(repeat: int) -> None:
    data = read_fixture()
    gc.freeze()  # the fixture's objects are not the router's: keep them out of collections
    for run in data["runs"]:
        if run["scenario"] not in ("ttft", "ttft-tuned"):
            continue
        times: list[float] = []
        for _ in range(repeat):
            r = Replayer(run["config"], run["workers"])
            for step in run["decisions"]:
                workers, req, now = r.prepare(step["input"])
                t0 = time.perf_counter()
                r.policy.decide(workers, req, now)
                times.append(time.perf_counter() - t0)
        print(f"{run['profile']:>6} {run['scenario']:<11} {_stats(times)}", flush=True)


def wide_fleet(n_workers: int, iterations: int) -> None:
    rng = random.Random(3)
    names = [f"w{i}" for i in range(n_workers)]
    r = Replayer({}, names)
    assert isinstance(r.cfg, PolicyConfig)
    for w in r.workers:
        w.load.running = rng.randint(0, 20)
        w.load.queued_prefill_tokens = rng.randint(0, 8000)
        w.load.engine = EngineMetrics(float(w.load.running + 2), 1.0, 0.5, 0.0, w.load.running, 0)
    inp = {
        "t": 1.0,
        "n": 4096,
        "reuse": [rng.randrange(0, 4096, 16) for _ in names],
        "cov": None,
        "own": None,
        "session": "s",
        "eligible": list(range(n_workers)),
        "mean": 1024.0,
    }
    times = []
    cpu = 0.0
    for _ in range(iterations):
        route_input = _route_input(inp, names)
        c0, t0 = time.process_time(), time.perf_counter()
        r.policy.decide(r.workers, route_input, 1.0)
        times.append(time.perf_counter() - t0)
        cpu += time.process_time() - c0
    # CPU time too: on a shared machine the wall clock also counts other jobs' time slices
    cpu_us = cpu / iterations * 1e6
    print(
        f"{n_workers} workers, ttft          {_stats(times)}  CPU mean {cpu_us:.1f} us", flush=True
    )


def _route_input(inp: dict[str, object], names: list[str]) -> object:
    from kvroute.router.routing.policy import RouteInput

    reuse = inp["reuse"]
    assert isinstance(reuse, list)
    return RouteInput(4096, dict(zip(names, reuse, strict=True)), "s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeat", type=int, default=5, help="passes over the fixture")
    p.add_argument(
        "--wide", type=int, nargs="*", default=[64], help="synthetic fleet sizes to decide on"
    )
    p.add_argument("--iterations", type=int, default=2000, help="decisions per fleet size")
    p.add_argument("--no-fixture", action="store_true", help="only the synthetic fleets")
    args = p.parse_args()
    if not args.no_fixture:
        fixture_runs(args.repeat)
    for n in args.wide:
        wide_fleet(n, args.iterations)


if __name__ == "__main__":
    main()
