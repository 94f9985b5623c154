"""Record vLLM's own KV events and prefix hits for the conformance tests.

Run with the vLLM environment's python (.venv-vllm/bin/python), never imported by pytest:

    .venv-vllm/bin/python tests/conformance/vllm_driver.py --out FILE [--only NAME ...]
    .venv-vllm/bin/python tests/conformance/vllm_driver.py --serve DIR --only NAME ...

For each scenario (vllm_scenarios.py: a cache layout plus a request workload) it builds a real
vLLM `KVCacheManager` through `kvroute.sim.vllm_backend`, drives seeded requests like vLLM's
scheduler
(vllm_workloads.py), publishes every step's batch through vLLM's real `ZmqEventPublisher`,
captures the raw 3-frame messages with a real SUB socket and one replay through a DEALER
(vllm_wire.py), and at many points asks vLLM for the native hit of probe prompts. Fleets do the
same for several workers at once. The result is one msgpack file:

    {"vllm_version",
     "scenarios": [{"name", "about", "config", "transport", "topic", "dp_rank", "int_hashes",
                    "alignment", "partial_hash_hits", "limit",
                    "frames": [[topic, seq, payload], ...], "replay": {"start_seq", "frames"},
                    "probes": [{"after", "tokens", "lora_name", "cache_salt", "hit",
                                "per_group", "label", "expect", "prompt_logprobs"}],
                    "stats"}],
     "fleets": [{"name", "about", "workers": {name: {"config", "alignment", "topic", "frames",
                 "stats"}}, "probes": [{"after": {worker: n}, "tokens", "lora_name",
                 "cache_salt", "hits": {worker: hit}, "per_group": {worker: [...]}, "label"}]}]}

`after` is the number of published batches (seq 0 .. after-1) that the probe's answer reflects.
A probe's `expect`, when set, is the value docs/reference/vllm-kv-events.md §7.6 states for it.
`--serve` publishes the named scenarios again on ipc endpoints for a bridge in another process
(see ServedPublisher); the payloads are byte-identical to the recording's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import msgspec  # noqa: E402
import vllm  # noqa: E402
from vllm_scenarios import Fleet, Scenario, fleets, scenarios  # noqa: E402
from vllm_wire import ServedPublisher, WireCapture  # noqa: E402
from vllm_workloads import FleetLoop, FleetRecorder, Recorder, run_workload  # noqa: E402

from kvroute.sim.vllm_backend import SchedulerLoop, VllmCacheBackend, describe  # noqa: E402


@contextlib.contextmanager
def _int_hash_mode(enabled: bool) -> Iterator[None]:
    key = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
    old = os.environ.get(key)
    os.environ[key] = "1" if enabled else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ[key]
        else:
            os.environ[key] = old


def _drive(sc: Scenario, sink: WireCapture | ServedPublisher) -> tuple[Recorder, Any]:
    """Run the scenario's script or workload, publishing every batch to `sink`.

    Deterministic: the same scenario publishes the same payloads (seeded tokens, fixed hash
    seed, a counting clock), which lets a served run be compared with the recording.
    """
    tick = iter(range(1 << 40))
    with _int_hash_mode(sc.int_hashes):
        backend = VllmCacheBackend(sc.config)
        loop = SchedulerLoop(
            backend,
            clock=lambda: 1_700_000_000.0 + next(tick) / 1000,
            publish=sink.publish,
        )
        rec = Recorder(loop, sink, random.Random(sc.seed))
        if sc.script is not None:
            sc.script(rec)
        if sc.workload is not None:
            run_workload(rec, sc.workload)
    return rec, backend


def serve(names: list[str], directory: Path, pause_at: int) -> None:
    """Publish the named scenarios, in the order given, for a bridge to follow."""
    known = {sc.name: sc for sc in scenarios()}
    for sc in (known[name] for name in names):
        if sc.dp_rank:
            raise SystemExit("served scenarios use DP rank 0 (ipc endpoints cannot offset)")
        sink = ServedPublisher(sc.name, directory, sc.topic, pause_at)
        _drive(sc, sink)
        sink.finish()


def run_scenario(sc: Scenario) -> dict[str, Any]:
    started = time.monotonic()
    capture = WireCapture(sc.name, sc.transport, sc.topic, sc.dp_rank)
    try:
        rec, backend = _drive(sc, capture)
        loop = rec.loop
        capture.wait_all()
        start_seq = max(0, capture.published - 3)
        replay = capture.replay(start_seq) if capture.published else []
    finally:
        capture.close()
    stats = loop.stats
    return {
        "name": sc.name,
        "about": sc.about,
        "config": describe(sc.config),
        "transport": sc.transport,
        "topic": sc.topic,
        "dp_rank": sc.dp_rank,
        "int_hashes": sc.int_hashes,
        "alignment": backend.alignment,
        "partial_hash_hits": backend.partial_hits,
        "limit": sc.limit,
        "frames": capture.frames,
        "replay": {"start_seq": start_seq, "frames": replay},
        "probes": rec.probes,
        "stats": {
            "steps": stats.steps,
            "batches": stats.batches,
            "finished": stats.finished,
            "preemptions": stats.preemptions,
            "deferred_admissions": stats.deferred_admissions,
            "resets": stats.resets,
            "failed_resets": stats.failed_resets,
            "events": stats.events,
            "seconds": round(time.monotonic() - started, 3),
        },
    }


def run_fleet(fleet: Fleet) -> dict[str, Any]:
    started = time.monotonic()
    captures = {w: WireCapture(f"{fleet.name}-{w}", "inproc", f"kv@{w}", 0) for w in fleet.workers}
    try:
        tick = iter(range(1 << 40))
        loops = {
            w: SchedulerLoop(
                VllmCacheBackend(config),
                clock=lambda: 1_700_000_000.0 + next(tick) / 1000,
                publish=captures[w].publish,
            )
            for w, config in fleet.workers.items()
        }
        rng = random.Random(fleet.seed)
        rec = FleetRecorder(fleet.name, FleetLoop(loops, rng, fleet.replicas), captures, rng)
        run_workload(rec, fleet.workload)
        for capture in captures.values():
            capture.wait_all()
    finally:
        for capture in captures.values():
            capture.close()
    return {
        "name": fleet.name,
        "about": fleet.about,
        "workers": {
            w: {
                "config": describe(loops[w].backend.spec),
                "alignment": loops[w].backend.alignment,
                "topic": captures[w].topic,
                "frames": captures[w].frames,
                "stats": {"batches": loops[w].stats.batches, "events": loops[w].stats.events},
            }
            for w in fleet.workers
        },
        "probes": rec.probes,
        "seconds": round(time.monotonic() - started, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where to write the recording")
    parser.add_argument("--only", nargs="*", default=None, help="scenario names")
    parser.add_argument(
        "--serve", type=Path, metavar="DIR", help="publish on ipc endpoints in DIR instead"
    )
    parser.add_argument("--pause-at", type=int, default=12, help="(serve) batches before GO")
    parser.add_argument(
        "--extra-seeds", type=int, default=0, help="reseeded copies of the random scenarios"
    )
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(args.only or [], args.serve, args.pause_at)
        return 0
    if args.out is None:
        parser.error("--out is required")
    chosen = [s for s in scenarios(args.extra_seeds) if args.only is None or s.name in args.only]
    results = []
    for sc in chosen:
        result = run_scenario(sc)
        st = result["stats"]
        print(
            f"{sc.name}: {st['batches']} batches, {len(result['probes'])} probes, "
            f"{st['events']}, preemptions={st['preemptions']}, resets={st['resets']}, "
            f"{st['seconds']} s",
            file=sys.stderr,
        )
        results.append(result)
    fleet_results = []
    for fleet in fleets():
        if args.only is None or fleet.name in args.only:
            result = run_fleet(fleet)
            print(
                f"{fleet.name}: {len(result['probes'])} probes over {len(fleet.workers)} "
                f"workers, {result['seconds']} s",
                file=sys.stderr,
            )
            fleet_results.append(result)
    data = {"vllm_version": vllm.__version__, "scenarios": results, "fleets": fleet_results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_bytes(msgspec.msgpack.encode(data))
    tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
