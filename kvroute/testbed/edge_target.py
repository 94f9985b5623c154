"""The target of the edge attacks (kvroute/testbed/edge_attacks.py): a real `kvroute serve`
on loopback, with edge bounds given as KVROUTE_* settings, in front of `kvroute sim`
engines; and reading its Prometheus counters. Shared by the edge tests and the benchmark."""

from __future__ import annotations

import os
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvroute.testbed.procs import ProcessGroup, free_port, wait_http
from kvroute.testbed.sim_fleet import Fleet, start_fleet

MIB = 1 << 20


@dataclass(frozen=True)
class Target:
    url: str
    host: str
    port: int
    pid: int  # the router process (its /proc memory figures)
    model: str
    log: Path  # the router's output


def sim_fleet(pg: ProcessGroup, run_dir: Path, workers: int = 2) -> Fleet:
    """Simulated engines fast enough that generation never limits an attack, with room for
    long streams and large prompts."""
    return start_fleet(
        pg,
        workers=workers,
        profile="dense",
        run_dir=run_dir,
        extra_args=["--speed", "1000", "--max-model-len", "65536", "--num-blocks", "32768"],
    )


def start_router(
    pg: ProcessGroup, fleet: Fleet, run_dir: Path, settings: Mapping[str, str], name: str
) -> Target:
    """`kvroute serve` for `fleet` with `settings` (KVROUTE_* variables); returns once it
    answers /health."""
    cfg = yaml.safe_load(Path(fleet.config_path).read_text())
    cfg["health"] = {"interval_s": 0.5}
    config = run_dir / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    port = free_port()
    cmd = [sys.executable, "-m", "kvroute", "serve", "--config", str(config)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    env = {**settings, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    child = pg.start(name, cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 60.0, child.popen)
    return Target(url, "127.0.0.1", port, child.popen.pid, fleet.model, child.log)


def metric(url: str, name: str, label: str = "") -> float:
    """The sum of the router's series `name` whose labels contain `label`."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " ")) and label in line
    )


def wait_metric(url: str, name: str, label: str, at_least: float, wait_s: float = 5.0) -> float:
    """The series once it reached `at_least`, or its value after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while (value := metric(url, name, label)) < at_least and time.monotonic() < deadline:
        time.sleep(0.1)
    return value
