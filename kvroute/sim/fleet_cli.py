"""`kvroute sim fleet`: N simulated engines (each with its bridge) as processes on loopback.

Each engine is a `kvroute sim` child process (HTTP and ZMQ on free ephemeral ports, reported
on its stdout); each bridge a `kvroute bridge` child following that engine. Once all answer,
the fleet prints the addresses, writes the router config (`--config-out`, in the
format of `docs/configuration.md`: `kvroute serve --config PATH` accepts it as is), prints one JSON
line {"fleet_ready": true, ...}, and waits. SIGINT/SIGTERM (or Ctrl-C) stops every child:
SIGTERM first, SIGKILL after a grace period. Children also get SIGTERM if the fleet process
dies (Linux PR_SET_PDEATHSIG, `kvroute.lifeline`), so nothing outlives it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from kvroute import lifeline
from kvroute.sim.engine_args import add_engine_args, engine_argv, engine_config
from kvroute.sim.model import MODEL_DIR

_BRIDGE_PORTS = re.compile(r"gRPC on port (\d+)(?:, HTTP on port (\d+))?")


def _spawn(argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **lifeline.env(signal.SIGTERM)},
    )


def _read_line(proc: subprocess.Popen[str], deadline: float, what: str) -> str:
    """The child's next stdout line, or RuntimeError if it exits or the deadline passes."""
    assert proc.stdout is not None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"{what} did not report ready in time")
        ready, _, _ = select.select([proc.stdout], [], [], min(left, 0.2))
        if ready:
            line = proc.stdout.readline()
            if line:
                return line.strip()
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} during start-up")


def _drain(stream: IO[str] | None, prefix: str) -> None:
    """Keep reading a child's stdout so it never blocks on a full pipe."""
    if stream is None:
        return

    def run() -> None:
        for line in stream:
            sys.stderr.write(f"[{prefix}] {line}")

    threading.Thread(target=run, daemon=True, name=f"drain-{prefix}").start()


@dataclass
class Member:
    """One engine of the fleet, with its bridge."""

    name: str
    engine: subprocess.Popen[str]
    url: str
    events: str | None
    replay: str | None
    topic: str
    role: str = "both"  # both, prefill or decode (the router's worker role)
    bridge: subprocess.Popen[str] | None = None
    bridge_addr: str | None = None
    bridge_http: str | None = None

    def info(self) -> dict[str, Any]:
        """Addresses and process ids, as printed and written to --info-out."""
        return {
            "name": self.name,
            "url": self.url,
            "events": self.events,
            "replay": self.replay,
            "topic": self.topic,
            "bridge": self.bridge_addr,
            "bridge_http": self.bridge_http,
            "engine_pid": self.engine.pid,
            "bridge_pid": self.bridge.pid if self.bridge else None,
            "role": self.role,
        }


@dataclass
class Fleet:
    """Starts and stops the child processes."""

    workers: int
    engine_args: list[str]
    bridges: bool = True
    startup_timeout: float = 60.0
    bridge_nice: int | None = None  # None: the bridge's default
    bridge_sched_idle: bool = False  # the bridges in Linux's SCHED_IDLE class
    prefill: int = 0  # engines that only prefill (kv_producer), after the mixed ones
    decode: int = 0  # engines that only decode (kv_consumer)
    members: list[Member] = field(default_factory=list)

    def _plan(self) -> list[tuple[str, str, list[str]]]:
        """(name, role, extra engine options) of every engine to start."""
        plan = [(f"sim-{i}", "both", []) for i in range(self.workers)]
        producer, consumer = ["--kv-role", "kv_producer"], ["--kv-role", "kv_consumer"]
        plan += [(f"prefill-{i}", "prefill", producer) for i in range(self.prefill)]
        plan += [(f"decode-{i}", "decode", consumer) for i in range(self.decode)]
        return plan

    def start(self) -> list[Member]:
        """Start the engines, then their bridges; RuntimeError (after stopping everything)
        if one does not come up in time."""
        cmd = [sys.executable, "-m", "kvroute", "sim"]
        plan = self._plan()
        try:
            procs = [
                _spawn([*cmd, *self.engine_args, *extra, "--name", name]) for name, _, extra in plan
            ]
            deadline = time.monotonic() + self.startup_timeout
            for i, proc in enumerate(procs):
                name, role, _ = plan[i]
                try:
                    info = json.loads(_read_line(proc, deadline, f"engine {name}"))
                except Exception:
                    for p in procs[i:]:
                        self._terminate([p])
                    raise
                _drain(proc.stdout, name)
                self.members.append(
                    Member(
                        name,
                        proc,
                        info["url"],
                        info.get("events"),
                        info.get("replay"),
                        info.get("topic", ""),
                        role,
                    )
                )
            if self.bridges:
                self._start_bridges(deadline)
        except BaseException:
            self.stop()
            raise
        return self.members

    def _start_bridges(self, deadline: float) -> None:
        for m in self.members:
            if m.events is None:
                continue
            argv = [sys.executable, "-m", "kvroute", "bridge", "--engine", m.events,
                    "--topic", m.topic, "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
                    "--log-level", "WARNING"]  # fmt: skip
            if m.replay:
                argv += ["--replay", m.replay]
            if self.bridge_nice is not None:
                argv += ["--nice", str(self.bridge_nice)]
            if self.bridge_sched_idle:
                argv.append("--sched-idle")
            m.bridge = _spawn(argv)
        for m in self.members:
            if m.bridge is None:
                continue
            while True:
                line = _read_line(m.bridge, deadline, f"bridge of {m.name}")
                found = _BRIDGE_PORTS.search(line)
                if found:
                    break
            m.bridge_addr = f"127.0.0.1:{found.group(1)}"
            if found.group(2):
                m.bridge_http = f"http://127.0.0.1:{found.group(2)}"
            _drain(m.bridge.stdout, f"bridge-{m.name}")

    @staticmethod
    def _terminate(procs: list[subprocess.Popen[str]], grace: float = 10.0) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop(self) -> None:
        """Bridges first (they follow the engines), then engines; nothing is left running."""
        self._terminate([m.bridge for m in self.members if m.bridge is not None])
        self._terminate([m.engine for m in self.members])

    def dead(self) -> list[str]:
        """What has exited, one line per child process."""
        out = []
        for m in self.members:
            for what, p in (("engine", m.engine), ("bridge", m.bridge)):
                if p is not None and p.poll() is not None:
                    out.append(f"{m.name} {what} exited with code {p.returncode}")
        return out


def router_config(
    members: list[Member],
    model: str,
    alignment: int | None,
    via_bridge: bool,
    runner: str = "generate",
) -> dict[str, Any]:
    """The router config for this fleet (the `kvroute serve --config` format)."""
    workers = []
    for m in members:
        w: dict[str, Any] = {"name": m.name, "url": m.url}
        if via_bridge and m.bridge_addr:
            w["bridge"] = m.bridge_addr
        elif m.events:
            w["zmq"] = m.events
            if m.replay:
                w["replay"] = m.replay
            w["topic"] = m.topic
        w["model"] = model
        if m.role != "both":
            w["role"] = m.role
        workers.append(w)
    # The router's tokenizer is the engines' own model directory, so its ids are exact and
    # plain chat requests can reach the engines as completions of those ids.
    spec: dict[str, Any] = {"tokenizer": str(MODEL_DIR), "send_token_ids": True}
    if alignment is not None:
        spec["alignment"] = alignment
    if runner == "pooling":
        # the simulated embedder reads the prefix cache (last-token pooling)
        spec["embeddings_use_cache"] = True
    return {"workers": workers, "models": {model: spec}}


def build_parser() -> argparse.ArgumentParser:
    """The `kvroute sim fleet` options."""
    p = argparse.ArgumentParser(
        prog="kvroute sim fleet",
        description="Run N simulated vLLM engines, each with a kvroute bridge, on loopback.",
    )
    p.add_argument(
        "--workers",
        type=int,
        help="number of mixed engines (default 2, or 0 with --prefill/--decode)",
    )
    p.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="engines that only prefill (--kv-role kv_producer; router role prefill)",
    )
    p.add_argument(
        "--decode",
        type=int,
        default=0,
        help="engines that only decode (--kv-role kv_consumer; router role decode)",
    )
    p.add_argument("--config-out", type=Path, help="write the router config (YAML) here")
    p.add_argument("--info-out", type=Path, help="write the fleet's addresses (JSON) here")
    p.add_argument(
        "--no-bridge",
        action="store_true",
        help="no bridges: the router config subscribes to the engines' ZMQ directly",
    )
    p.add_argument(
        "--bridge-nice",
        type=int,
        help="the bridges' CPU niceness increment (default: the bridge's own default)",
    )
    p.add_argument(
        "--bridge-sched-idle",
        action="store_true",
        help="run the bridges in Linux's SCHED_IDLE class (see `kvroute bridge --sched-idle`)",
    )
    p.add_argument("--startup-timeout", type=float, default=60.0)
    add_engine_args(p)
    return p


def _bridge_available() -> bool:
    return importlib.util.find_spec("kvroute.bridge.app") is not None


def main(argv: list[str]) -> int:
    """`kvroute sim fleet`: run until a signal or a child's death (then 1)."""
    args = build_parser().parse_args(argv)
    pd = args.prefill or args.decode
    if args.workers is None:
        args.workers = 0 if pd else 2
    if pd and (args.prefill < 1 or args.decode < 1):
        print("kvroute sim fleet: --prefill and --decode need at least 1 each", file=sys.stderr)
        return 2
    if args.workers < (0 if pd else 1):
        print("kvroute sim fleet: --workers must be at least 1", file=sys.stderr)
        return 2
    try:
        spec = engine_config(args).cache_spec()
    except ValueError as exc:
        print(f"kvroute sim fleet: {exc}", file=sys.stderr)
        return 2
    bridges = not args.no_bridge and not args.no_events
    if bridges and not _bridge_available():
        print("kvroute sim fleet: bridge package not installed; using --no-bridge", file=sys.stderr)
        bridges = False
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    fleet = Fleet(
        args.workers,
        engine_argv(args),
        bridges,
        args.startup_timeout,
        args.bridge_nice,
        args.bridge_sched_idle,
        args.prefill,
        args.decode,
    )
    try:
        members = fleet.start()
    except RuntimeError as exc:
        print(f"kvroute sim fleet: {exc}", file=sys.stderr)
        return 1
    try:
        config = router_config(members, args.model, spec.alignment, bridges, args.runner)
        if args.config_out:
            args.config_out.parent.mkdir(parents=True, exist_ok=True)
            header = f"# router config written by: kvroute sim fleet {' '.join(argv)}\n"
            args.config_out.write_text(header + yaml.safe_dump(config, sort_keys=False))
        info = {
            "fleet_ready": True,
            "pid": os.getpid(),
            "model": args.model,
            "profile": args.profile,
            "tokenizer": str(MODEL_DIR),
            "config": str(args.config_out) if args.config_out else None,
            "workers": [m.info() for m in members],
        }
        if args.info_out:
            args.info_out.write_text(json.dumps(info, indent=2) + "\n")
        for m in members:
            bridge = f"  bridge {m.bridge_addr}" if m.bridge_addr else ""
            print(f"{m.name}: {m.url}  events {m.events}  replay {m.replay}{bridge}",
                  file=sys.stderr)  # fmt: skip
        print(json.dumps(info), flush=True)
        failed = False
        while not stop.wait(0.5):
            problems = fleet.dead()
            if problems:
                print(f"kvroute sim fleet: {'; '.join(problems)}; stopping", file=sys.stderr)
                failed = True
                break
    finally:
        fleet.stop()
    return 1 if failed else 0
