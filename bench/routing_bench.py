"""Benchmark 1: routing quality and latency, every router in front of the same fleet.

For each model profile (dense, swa, mamba) and each router, in sequence: start a fresh
simulated fleet (cold caches), start the router in front of it, replay the same trace
through it, read the engines' own prefix-cache counters before and after, stop both. The
results go to ``bench/results/routing_<profile>.{json,md,png}``.

Routers (``--routers``, see :mod:`kvroute.testbed.routers`): kvroute with its default policy, with
the index limited to full-attention groups, session affinity, least load and round robin;
``smg`` (cache_aware, round_robin) and ``vllm-router`` (cache_aware) from ``.venv-peers``;
the oracle (asks every engine for its true hit before each request); and the bench's own
naive text-prefix and round-robin proxies.

``--smoke`` runs a two-engine fleet, a short trace and two routers in well under a minute.

Offloaded KV (``--preset tiered``): chat conversations whose users think long enough between
turns that a small GPU pool has dropped their history by the time they return; with
``--fleet-args`` giving the engines a small ``--num-blocks`` and a large ``--cpu-offload-gib``
(``TIERED_FLEET_ARGS``), a returning turn can come back from an engine's CPU tier. Each row
then has ``cached_by_source``: the prompt tokens the engines took from their GPU (``device``)
and CPU (``host``) tiers (vLLM's ``vllm:prompt_tokens_cached_by_source``).

``--pd P,D`` is the prefill/decode profile: the fleet is ``kvroute sim fleet --prefill P
--decode D`` (engines with vLLM's NIXL connector roles, no mixed ones) and the routers are
those that split a request into a prefill and a decode (``PD_ROUTERS``: kvroute, whose
config gives it the workers' roles, the peers' P/D modes and a round-robin P/D proxy). Each
row then has the time per output token and, by pool, the cached tokens, and the KV blocks
the decode engines pulled (results ``routing_<profile>_pd``).

``--workload pool-pressure`` replays the ``pool-pressure`` preset (long conversations only)
with ``--clients`` closed-loop clients (default 64), each one conversation at a time, on
engines whose pools hold ``--pool-share`` (default 0.5) of the live conversations' tokens:
the placement-under-memory-pressure benchmark (``bench/pool_pressure.py`` reports it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench.report import routing_markdown, routing_plot
from kvroute.testbed.loadgen import LoadConfig, progress_printer, run_trace
from kvroute.testbed.peers import find_peers
from kvroute.testbed.procs import (
    ProcessGroup,
    group_cpu_by_command,
    group_cpu_seconds,
    pin_process,
    pinned,
    split_cpus,
)
from kvroute.testbed.routers import (
    ROUTERS,
    RouterSpec,
    RouterUnavailable,
    RunningRouter,
    kvroute_available,
    kvroute_decision_reasons,
    kvroute_decisions,
    kvroute_predictions,
    start_router,
)
from kvroute.testbed.sim_fleet import (
    Engine,
    Fleet,
    FleetError,
    delta,
    pd_pools,
    scrape,
    start_fleet,
    vllm_python,
)
from kvroute.testbed.stats import summarize
from kvroute.testbed.textgen import TokenSpace
from kvroute.testbed.trace import TraceRequest, from_mooncake, read_jsonl, read_mooncake
from kvroute.testbed.workload import (
    PRESETS,
    ChatSpec,
    WorkloadSpec,
    describe,
    generate,
    live_working_set_tokens,
)

RESULTS = Path(__file__).resolve().parent / "results"
# The simulated GPU runs 5x slower than the modelled H100 so that its time, not the CPU noise
# of a small shared machine, dominates TTFT; 2048 blocks (32k tokens) per engine make caches
# fill and evict under the default trace, so where a prefix lives matters.
FULL_FLEET_ARGS = ("--speed", "0.2", "--num-blocks", "2048")
SMOKE_FLEET_ARGS = ("--speed", "1.0", "--num-blocks", "2048")
# A tiered fleet: 400 GPU blocks (6,400 tokens) and a 4 GiB CPU tier (32,768 tokens) per engine.
TIERED_FLEET_ARGS = (
    "--speed", "0.2", "--num-blocks", "400", "--max-model-len", "4096",
    "--cpu-offload-gib", "4",
)  # fmt: skip
# Conversations only: 64 chats of 3-6 turns that start within 30 s and return after 12 s of
# thought on average, long enough for the other conversations to push them out of a small GPU
# pool, not out of a CPU tier several times larger.
TIERED = WorkloadSpec(
    duration_s=30.0,
    chat=ChatSpec(
        sessions=64,
        turns=(3, 6),
        system_tokens=(400, 1200),
        user_tokens=(60, 300),
        answer_tokens=(40, 120),
        think_time_s=12.0,
    ),
    agent=replace(WorkloadSpec().agent, sessions=0),
    burst=replace(WorkloadSpec().burst, bursts=0),
)
BENCH_PRESETS: dict[str, WorkloadSpec] = {**PRESETS, "tiered": TIERED}
# Pool pressure: the engines at half the modelled GPU's speed, so re-prefilling lost history
# costs time the queues feel; the pools are sized from the trace (``pressure_fleet_args``).
PRESSURE_SPEED = "0.5"
PRESSURE_CLIENTS = 64
BLOCK_TOKENS = 16  # the simulated engines' KV block size
PROFILES = ("dense", "swa", "mamba")
FULL_ROUTERS = (
    "kvroute",
    "kvroute-fa-only",
    "kvroute-session",
    "kvroute-least-load",
    "kvroute-round-robin",
    "smg-cache-aware",
    "smg-round-robin",
    "vllm-router",
    "oracle",
)
# --pd: the routers that run a request's prefill and decode on different engines
PD_ROUTERS = ("kvroute", "vllm-router-pd", "smg-pd", "pd-round-robin")
SMOKE_ROUTERS = ("kvroute", "kvroute-round-robin")
# Until the router lands, the smoke run compares the bench's own proxies.
SMOKE_FALLBACK = ("bench-prefix", "bench-round-robin")


@dataclass
class BenchConfig:
    profiles: tuple[str, ...]
    routers: tuple[str, ...]
    workers: int
    smoke: bool
    trace_name: str
    trace: list[TraceRequest]
    load: LoadConfig
    slo_ttft_s: float
    out_dir: Path
    fleet_args: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)
    suffix: str = ""
    cache_backend: str = "sim"
    fleet_python: str | None = None
    # --router-cpus: the router alone on these, everything else (engines, bridges, client)
    # on the rest; None = all share every CPU
    router_cpus: tuple[int, ...] | None = None
    fleet_cpus: tuple[int, ...] | None = None
    # --bridges: "router" = only runs of a router that reads them (kvroute) have bridges, on
    # the router's CPUs; "fleet" = every run's fleet has bridges, beside the engines
    bridges: str = "router"
    # with bridges "router": their scheduling class beside the router, "idle" (SCHED_IDLE: they
    # run only when the router does not) or "nice" (the bridge's default niceness, 10)
    bridge_sched: str = "idle"
    # --pd: (prefill engines, decode engines) instead of `workers` mixed ones
    pd: tuple[int, int] | None = None


def _start_fleet_retrying(
    pg: ProcessGroup,
    cfg: BenchConfig,
    profile: str,
    run_dir: Path,
    fleet_args: Sequence[str],
    attempts: int = 2,
) -> Fleet:
    """Start the fleet; once more if it fails (start-up races on a busy machine)."""
    for attempt in range(attempts):
        try:
            return start_fleet(
                pg,
                workers=0 if cfg.pd else cfg.workers,
                pd=cfg.pd,
                profile=profile,
                run_dir=run_dir,
                extra_args=fleet_args,
                python=cfg.fleet_python,
                timeout_s=300.0 if cfg.fleet_python else 90.0,
                cpus=cfg.fleet_cpus,
            )
        except FleetError as exc:
            if attempt + 1 == attempts:
                raise
            print(f"[{profile}] fleet did not start, retrying: {exc}"[:300], file=sys.stderr)
            pg.stop_all()
    raise AssertionError("unreachable")


def _cpu_by_role(router: RunningRouter, fleet: Fleet) -> dict[str, float]:
    """CPU seconds so far of the router, the engines and the bridges (each child has its own
    session, so its pid is its process group's id)."""
    roles = {"router": group_cpu_seconds(router.child.popen.pid), "engines": 0.0, "bridges": 0.0}
    for cmdline, cpu in group_cpu_by_command(fleet.child.popen.pid).values():
        if " bridge " in f" {cmdline} ":
            roles["bridges"] += cpu
        elif " sim " in f" {cmdline} ":
            roles["engines"] += cpu  # the fleet's supervisor too (idle)
    return roles


def _bridge_pids(fleet: Fleet) -> list[int]:
    found = group_cpu_by_command(fleet.child.popen.pid)
    return [pid for pid, (cmdline, _) in found.items() if " bridge " in f" {cmdline} "]


def cached_by_source(engines: Sequence[Engine]) -> dict[str, float]:
    """Prompt tokens the engines took from each cache tier so far (`device`: GPU, `host`:
    CPU), summed over engines, from vLLM's `vllm:prompt_tokens_cached_by_source`."""
    out: dict[str, float] = {}
    for e in engines:
        try:
            with urllib.request.urlopen(e.url + "/metrics", timeout=5.0) as resp:
                text = resp.read().decode()
        except (OSError, ValueError):
            continue
        for fam in text_string_to_metric_families(text):
            if fam.name != "vllm:prompt_tokens_cached_by_source":
                continue
            for sample in fam.samples:
                if sample.name.endswith("_total"):
                    source = sample.labels.get("source", "")
                    out[source] = out.get(source, 0.0) + float(sample.value)
    return out


def _fleet_args(cfg: BenchConfig, spec: RouterSpec) -> tuple[str, ...]:
    """The fleet's options for one router's run: with ``--bridges router``, no bridges unless
    the router reads them (the engines publish their events either way), and kvroute's
    bridges in the scheduling class the spec asks for, else the bench's ``--bridge-sched``
    (which applies only beside the router; beside the engines they keep their niceness)."""
    if cfg.bridges == "router" and spec.kind != "kvroute":
        if "--no-bridge" in cfg.fleet_args:
            return cfg.fleet_args
        return (*cfg.fleet_args, "--no-bridge")
    sched = spec.bridge_sched or (cfg.bridge_sched if cfg.bridges == "router" else "nice")
    return (*cfg.fleet_args, "--bridge-sched-idle") if sched == "idle" else cfg.fleet_args


def run_router(cfg: BenchConfig, profile: str, name: str, run_dir: Path) -> dict[str, Any]:
    """One router on a fresh fleet: the result row (status ok / unavailable / failed)."""
    spec = ROUTERS[name]
    row: dict[str, Any] = {"name": name, "label": spec.label, "status": "ok"}
    peers = find_peers()
    t0 = time.monotonic()
    with ProcessGroup(run_dir / "logs" / name) as pg:
        try:
            fleet = _start_fleet_retrying(pg, cfg, profile, run_dir, _fleet_args(cfg, spec))
            if cfg.bridges == "router" and cfg.router_cpus is not None:
                for pid in _bridge_pids(fleet):
                    pin_process(pid, cfg.router_cpus)
            router = start_router(pg, spec, fleet, peers, cpus=cfg.router_cpus)
        except RouterUnavailable as exc:
            return {**row, "status": "unavailable", "reason": str(exc)}
        except (FleetError, RuntimeError, TimeoutError) as exc:
            return {**row, "status": "failed", "reason": str(exc)[:2000]}
        print(f"[{profile}] {name}: replaying {len(cfg.trace)} requests", file=sys.stderr)
        load_before = os.getloadavg()[0]
        before = scrape(fleet.engines)
        sources_before = cached_by_source(fleet.engines)
        load = replace(cfg.load, url=router.url, model=fleet.model)
        cpu0, replay0 = _cpu_by_role(router, fleet), time.monotonic()
        with pinned(cfg.fleet_cpus):  # the load generator runs in this process
            records = asyncio.run(
                run_trace(cfg.trace, load, progress_printer(len(cfg.trace), every=100))
            )
        # CPU time over the replay: a busy router loop delays every request, and the engines'
        # steps run late when their CPU is shared with much else (bridges, metric scrapes).
        cpu1, replay_s = _cpu_by_role(router, fleet), time.monotonic() - replay0
        row["cpu_s"] = {role: round(cpu1[role] - cpu0.get(role, 0.0), 2) for role in cpu1}
        row["router_busy"] = round(row["cpu_s"]["router"] / max(replay_s, 1e-9), 3)
        after = scrape(fleet.engines)
        sources = cached_by_source(fleet.engines)
        row["cached_by_source"] = {
            k: round(v - sources_before.get(k, 0.0)) for k, v in sources.items() if v
        }
        # The machine is shared: keep how busy it was, since TTFT includes CPU contention.
        row["loadavg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        if spec.kind == "kvroute":
            row["prediction"] = kvroute_predictions(router.url)
            row["decisions"] = kvroute_decision_reasons(router.url)
            decisions = kvroute_decisions(router.url)
        else:
            decisions = None
    summary = summarize(records, cfg.slo_ttft_s)
    row.update(delta(before, after))
    if cfg.pd:
        row["pd"] = pd_pools(fleet.engines, row, summary.ok)
    row["summary"] = summary.to_json()
    row["wall_s"] = round(time.monotonic() - t0, 1)
    with open(run_dir / f"{name}.records.jsonl", "w", encoding="utf-8") as out:
        for r in records:
            out.write(json.dumps(r.to_json()) + "\n")
    if decisions is not None:  # in arrival order: records sorted by `sent`, prompt_tokens agree
        with open(run_dir / f"{name}.decisions.jsonl", "w", encoding="utf-8") as out:
            for d in decisions:
                out.write(json.dumps(d) + "\n")
    s = summary
    print(
        f"[{profile}] {name}: cached {row['engine_cached_tokens']:,}/"
        f"{row['engine_prompt_tokens']:,} engine tokens (usage: {s.cached_ratio:.1%}), "
        f"TTFT p50 {s.ttft_p50} p99 {s.ttft_p99}, {s.errors} errors"
        + (f", {row['pd']['kv_blocks_per_request']} blocks pulled per request" if cfg.pd else ""),
        file=sys.stderr,
    )
    return row


def run_profile(cfg: BenchConfig, profile: str, command: str) -> dict[str, Any]:
    run_dir = cfg.out_dir / "runs" / f"routing_{profile}{cfg.suffix}"
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [run_router(cfg, profile, name, run_dir) for name in cfg.routers]
    info = describe(cfg.trace)
    mode = (
        f"closed loop, {cfg.load.clients} clients, one conversation each at a time"
        if cfg.load.clients
        else f"closed loop, {cfg.load.concurrency} in flight"
        if cfg.load.time_scale is None
        else f"open loop at {cfg.load.time_scale}x trace time"
        + (f", at most {cfg.load.concurrency} in flight" if cfg.load.concurrency else "")
    )
    result: dict[str, Any] = {
        "benchmark": "routing",
        "profile": profile,
        "smoke": cfg.smoke,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "fleet": {
            "workers": sum(cfg.pd) if cfg.pd else cfg.workers,
            "pd": list(cfg.pd) if cfg.pd else None,
            "profile": profile,
            "cache_backend": cfg.cache_backend,
            "args": list(cfg.fleet_args),
        },
        "trace": {"name": cfg.trace_name, **info},
        "replay": mode,
        "slo_ttft_s": cfg.slo_ttft_s,
        "notes": cfg.notes,
        "routers": rows,
    }
    stem = cfg.out_dir / f"routing_{profile}{cfg.suffix}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    stem.with_suffix(".md").write_text(routing_markdown(result))
    routing_plot(result, stem.with_suffix(".png"))
    print(routing_markdown(result))
    return result


def pressure_fleet_args(
    trace: Sequence[TraceRequest], clients: int, workers: int, pool_share: float
) -> tuple[str, ...]:
    """Fleet options for the pool-pressure workload: each engine's pool holds ``pool_share`` of
    its part of the live working set (``live_working_set_tokens`` over ``workers``)."""
    per_worker = live_working_set_tokens(trace, clients) / max(1, workers)
    blocks = max(64, round(pool_share * per_worker / BLOCK_TOKENS))
    return ("--speed", PRESSURE_SPEED, "--num-blocks", str(blocks))


def build_config(args: argparse.Namespace) -> BenchConfig:
    space = TokenSpace.discover()
    notes: list[str] = []
    if args.workload == "pool-pressure" and (args.mooncake or args.trace or args.preset):
        raise SystemExit("--workload pool-pressure generates its own trace (no --trace/--preset)")
    if args.workload == "pool-pressure":
        args.preset = "pool-pressure"
    if args.mooncake:
        trace = from_mooncake(
            read_mooncake(args.mooncake), space, time_scale=1.0, max_output_tokens=256
        )
        trace_name = f"mooncake:{Path(args.mooncake).name}"
        notes.append("no session header sent: a Mooncake trace records no session ids")
    elif args.trace:
        trace = read_jsonl(args.trace)
        trace_name = Path(args.trace).name
    else:
        preset = args.preset or ("smoke" if args.smoke else "default")
        spec = BENCH_PRESETS[preset]
        if args.seed is not None:
            spec = replace(spec, seed=args.seed)
        if args.duration is not None:
            spec = replace(spec, duration_s=args.duration)
        trace = generate(spec, space)
        trace_name = f"preset {preset}, seed {spec.seed}"
    if not space.exact:
        notes.append("token lengths approximate: the sim tokenizer was not found")
    pd = parse_pd(args.pd)
    if args.routers:
        routers = tuple(r.strip() for r in args.routers.split(",") if r.strip())
    elif pd:
        routers = PD_ROUTERS
    elif args.smoke:
        routers = SMOKE_ROUTERS
        if kvroute_available() is not None:
            routers = SMOKE_FALLBACK
            notes.append("kvroute router not available: smoke compares the bench's proxies")
    else:
        routers = FULL_ROUTERS
    unknown = [r for r in routers if r not in ROUTERS]
    if unknown:
        raise SystemExit(f"unknown routers {unknown}; known: {sorted(ROUTERS)}")
    check_pd_routers(routers, pd)
    profiles = PROFILES if args.profile == "all" else (args.profile,)
    load = load_config(args)
    workers = args.workers or (2 if args.smoke else 4)
    if args.fleet_args is not None:
        fleet_args = tuple(shlex.split(args.fleet_args))
    elif args.workload == "pool-pressure":
        fleet_args = pressure_fleet_args(trace, load.clients or 0, workers, args.pool_share)
        live = live_working_set_tokens(trace, load.clients or 0)
        notes.append(
            f"{load.clients} closed-loop clients; live working set {live / 1000:.0f}k tokens, "
            f"pools {shlex.join(fleet_args[2:])} per engine ({args.pool_share:.0%} of it)"
        )
    else:
        fleet_args = SMOKE_FLEET_ARGS if args.smoke else FULL_FLEET_ARGS
    suffix = ("_pd" if pd else "") + ("_smoke" if args.smoke else "")
    if pd:
        notes.append(
            f"prefill/decode fleet: {pd[0]} prefill engines (kv_producer) and {pd[1]} decode "
            "engines (kv_consumer) pulling blocks over a modelled 400 Gb/s link"
        )
    fleet_python = None
    if args.cache_backend == "vllm":
        fleet_python = vllm_python()
        if fleet_python is None:
            raise SystemExit("--cache-backend vllm needs .venv-vllm (make vllm-env)")
        # vLLM engines start slowly (imports, the cache manager), more so four at once.
        fleet_args = (*fleet_args, "--cache-backend", "vllm", "--startup-timeout", "240")
        suffix = "_vllm" + suffix
        notes.append("engines use vLLM 0.33's own KVCacheManager (--cache-backend vllm)")
    # without CPUs of their own, kvroute's bridges would share the engines' CPUs while the
    # other routers ran none: without --router-cpus every run gets them, as before
    bridges = args.bridges if args.router_cpus else "fleet"
    router_cpus = fleet_cpus = None
    if args.router_cpus:
        try:
            router_cpus, fleet_cpus = split_cpus(
                [int(c) for c in args.router_cpus.split(",") if c.strip()]
            )
        except ValueError as exc:
            raise SystemExit(f"--router-cpus: {exc}") from None
        rc, fc = ",".join(map(str, router_cpus)), ",".join(map(str, fleet_cpus))
        if bridges == "router":
            notes.append(
                f"the router (and kvroute's bridges) run on CPU {rc}; engines and the load "
                f"generator on CPU {fc}"
            )
        else:
            notes.append(
                f"the router runs alone on CPU {rc}; engines, bridges and the load generator "
                f"on CPU {fc}"
            )
    if bridges == "router":
        notes.append(
            "bridges run only for kvroute, the one router that reads them"
            + (", in the SCHED_IDLE class" if args.bridge_sched == "idle" else ", at nice 10")
        )
    return BenchConfig(
        profiles=profiles,
        routers=routers,
        workers=workers,
        smoke=args.smoke,
        trace_name=trace_name,
        trace=trace,
        load=load,
        slo_ttft_s=args.slo_ttft,
        out_dir=Path(args.out_dir),
        fleet_args=fleet_args,
        notes=notes,
        suffix=suffix,
        cache_backend=args.cache_backend,
        fleet_python=fleet_python,
        router_cpus=router_cpus,
        fleet_cpus=fleet_cpus,
        bridges=bridges,
        bridge_sched=args.bridge_sched,
        pd=pd,
    )


def parse_pd(value: str | None) -> tuple[int, int] | None:
    """``--pd P,D`` as (prefill engines, decode engines), each at least 1; None if not given."""
    if value is None:
        return None
    try:
        prefill, decode = (int(x) for x in value.split(","))
    except ValueError:
        raise SystemExit(f"--pd takes PREFILL,DECODE engine counts, got {value!r}") from None
    if prefill < 1 or decode < 1:
        raise SystemExit(f"--pd needs at least one prefill and one decode engine, got {value!r}")
    return prefill, decode


def check_pd_routers(routers: Sequence[str], pd: tuple[int, int] | None) -> None:
    """A P/D fleet takes only routers that split requests into prefill and decode (kvroute
    does, from the roles in the fleet's config); a mixed fleet only those that do not."""
    if pd:
        wrong = [r for r in routers if not (ROUTERS[r].pd or ROUTERS[r].kind == "kvroute")]
        if wrong:
            raise SystemExit(f"--pd: {wrong} do not split prefill and decode; use {PD_ROUTERS}")
    else:
        wrong = [r for r in routers if ROUTERS[r].pd]
        if wrong:
            raise SystemExit(f"{wrong} need a prefill/decode fleet (--pd P,D)")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.routing_bench", description=__doc__)
    p.add_argument("--profile", choices=(*PROFILES, "all"), default="all")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--routers", default=None, help=f"comma list of {sorted(ROUTERS)}")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument(
        "--pd",
        default=None,
        metavar="P,D",
        help="prefill/decode fleet: P prefill-only and D decode-only engines (no mixed ones); "
        f"routers default to {','.join(PD_ROUTERS)}",
    )
    p.add_argument(
        "--preset",
        choices=sorted(BENCH_PRESETS),
        default=None,
        help="tiered: conversations that return late, for a fleet with a CPU tier (see above)",
    )
    p.add_argument(
        "--workload",
        choices=("preset", "pool-pressure"),
        default="preset",
        help="pool-pressure: long conversations, closed-loop --clients, pools sized by "
        "--pool-share (the preset of that name)",
    )
    p.add_argument(
        "--clients",
        type=int,
        default=None,
        help=f"closed-loop clients, one conversation each at a time (pool-pressure: default "
        f"{PRESSURE_CLIENTS})",
    )
    p.add_argument(
        "--pool-share",
        type=float,
        default=0.5,
        help="pool-pressure: each engine's KV pool as a share of its part of the live working "
        "set (0-1]",
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--duration", type=float, default=None, help="session start window (s)")
    p.add_argument("--trace", default=None, help="replay this kvroute JSONL trace")
    p.add_argument("--mooncake", default=None, help="replay this Mooncake trace")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--closed", action="store_true", help="closed loop (needs --concurrency)")
    p.add_argument("--concurrency", type=int, default=None)
    p.add_argument("--timeout", type=float, default=60.0, help="per request (s)")
    p.add_argument("--deadline", type=float, default=None, help="stop sending after (s)")
    p.add_argument("--slo-ttft", type=float, default=0.5, help="TTFT SLO for goodput (s)")
    p.add_argument(
        "--fleet-args",
        default=None,
        help=f"args for `kvroute sim fleet` (default: {shlex.join(FULL_FLEET_ARGS)})",
    )
    p.add_argument(
        "--cache-backend",
        choices=("sim", "vllm"),
        default="sim",
        help="vllm: the engines use vLLM's real KVCacheManager (results routing_<profile>_vllm)",
    )
    p.add_argument(
        "--router-cpus",
        default=None,
        help="comma list of CPUs for the router alone; engines, bridges and the client get the "
        "others (as in a deployment, where the engines' CPUs are not the router's)",
    )
    p.add_argument(
        "--bridges",
        choices=("fleet", "router"),
        default="router",
        help="router (default, with --router-cpus): only kvroute's runs have bridges (no other "
        "router reads them), on --router-cpus with the router, so the engines' CPU does the "
        "same work under every router; fleet (always without --router-cpus): every run's fleet "
        "has bridges, beside the engines (the earlier placement; "
        "bench/results/2026-12-03-bridge-placement-seeds-345)",
    )
    p.add_argument(
        "--bridge-sched",
        choices=("idle", "nice"),
        default="idle",
        help="with --bridges router: kvroute's bridges beside the router in Linux's SCHED_IDLE "
        "class (the default; bench/results/2026-12-03-bridge-sched-ab) or at the bridge's "
        "default niceness 10",
    )
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    if args.workload == "pool-pressure" and args.clients is None:
        args.clients = PRESSURE_CLIENTS
    if args.closed and not (args.concurrency or args.clients):
        p.error("--closed needs --concurrency or --clients")
    if not 0 < args.pool_share <= 1:
        p.error("--pool-share must be in (0, 1]")
    return args


def load_config(args: argparse.Namespace) -> LoadConfig:
    """How the load generator replays the trace (the URL and model are set per run)."""
    return LoadConfig(
        url="",
        model="",
        time_scale=None if args.closed or args.clients else args.time_scale,
        concurrency=args.concurrency,
        clients=args.clients,
        request_timeout_s=args.timeout,
        deadline_s=args.deadline,
        # A Mooncake trace records no session ids, and its clients sent none: inventing one
        # per request would hand every router a key that no real client of that trace sends.
        session_header=None if args.mooncake else LoadConfig.session_header,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = build_config(args)
    command = "python -m bench.routing_bench " + shlex.join(
        list(argv) if argv is not None else sys.argv[1:]
    )
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    failed = 0
    for profile in cfg.profiles:
        result = run_profile(cfg, profile, command)
        failed += sum(1 for r in result["routers"] if r["status"] == "failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
