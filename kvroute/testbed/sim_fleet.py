"""A simulated fleet for benchmarks: start it, learn its engines, read their counters.

The fleet is ``kvroute sim fleet --workers N --model-profile P --config-out PATH`` in its own
process group (:class:`kvroute.testbed.procs.ProcessGroup`). PATH is the router config the fleet
writes (``workers:`` with each engine's ``name`` and ``url``, see docs/configuration.md);
the bench reads the engine URLs from it to point the other routers at the same engines.

The engines' own Prometheus counters (vLLM names) are the ground truth for "tokens served
from cache": ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``, read
before and after a run.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvroute.testbed.procs import Child, ProcessGroup, wait_http


@dataclass(frozen=True)
class Engine:
    name: str
    url: str


@dataclass(frozen=True)
class Fleet:
    profile: str
    engines: tuple[Engine, ...]
    model: str
    config_path: Path
    child: Child


ROOT = Path(__file__).resolve().parents[2]  # the repository


def vllm_python() -> str | None:
    """The interpreter of the vLLM environment (``$KVROUTE_VLLM_PYTHON`` or ./.venv-vllm)."""
    candidate = os.environ.get("KVROUTE_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    return candidate if Path(candidate).exists() else None


class FleetError(RuntimeError):
    """The fleet did not come up (message includes the tail of its log)."""


def _served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=5.0) as resp:
        data = json.loads(resp.read())
    return str(data["data"][0]["id"])


def start_fleet(
    pg: ProcessGroup,
    *,
    workers: int,
    profile: str,
    run_dir: Path,
    extra_args: Sequence[str] = (),
    timeout_s: float = 90.0,
    python: str | None = None,
    cpus: Sequence[int] | None = None,
) -> Fleet:
    """Start a fleet and wait until every engine answers; raises :class:`FleetError`.

    ``python`` runs the fleet with another interpreter (vLLM's, for ``--cache-backend vllm``),
    with this checkout on its path. ``cpus``: the engines and bridges run only there.
    """
    config = run_dir / f"fleet-{profile}.yaml"
    config.unlink(missing_ok=True)
    cmd = [
        python or sys.executable,
        "-m",
        "kvroute",
        "sim",
        "fleet",
        "--workers",
        str(workers),
        "--model-profile",
        profile,
        "--config-out",
        str(config),
        *extra_args,
    ]
    env = {"PYTHONPATH": str(ROOT)} if python else None
    child = pg.start(f"fleet-{profile}", cmd, env=env, cpus=cpus)
    deadline = time.monotonic() + timeout_s
    try:
        while not config.exists() or not config.stat().st_size:
            if child.popen.poll() is not None:
                raise FleetError(f"fleet exited with {child.popen.returncode}")
            if time.monotonic() > deadline:
                raise FleetError(f"no config at {config} after {timeout_s}s")
            time.sleep(0.1)
        time.sleep(0.1)  # the writer may still be flushing
        cfg: Any = yaml.safe_load(config.read_text())
        engines = tuple(Engine(str(w["name"]), str(w["url"]).rstrip("/")) for w in cfg["workers"])
        for e in engines:
            wait_http(e.url + "/health", max(1.0, deadline - time.monotonic()), child.popen)
        model = next((str(w["model"]) for w in cfg["workers"] if w.get("model")), None)
        model = model or _served_model(engines[0].url)
    except (FleetError, TimeoutError, RuntimeError, OSError, KeyError, TypeError) as exc:
        raise FleetError(f"{exc}\n--- fleet log ---\n{child.tail(30)}") from None
    return Fleet(profile, engines, model, config, child)


@dataclass(frozen=True)
class EngineCounters:
    """Cumulative counters of one engine."""

    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    requests_ok: float = 0.0
    busy_seconds: float = 0.0  # simulated GPU time (sim-only, from /sim/state)
    preemptions: float = 0.0  # sim-only, from /sim/state


_COUNTERS = {
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
    "vllm:request_success": "requests_ok",
}


def parse_counters(text: str) -> EngineCounters:
    """Sum the counters we need over all label sets of a Prometheus text page."""
    acc: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        field = _COUNTERS.get(fam.name.removesuffix("_total"))
        if field is None:
            continue
        for s in fam.samples:
            if s.name.endswith("_total") or s.name == fam.name:
                acc[field] = acc.get(field, 0.0) + float(s.value)
    return EngineCounters(**acc)


def scrape(engines: Sequence[Engine], timeout_s: float = 5.0) -> list[EngineCounters]:
    """Every engine's counters (zeros for an engine that does not answer)."""
    out = []
    for e in engines:
        try:
            with urllib.request.urlopen(e.url + "/metrics", timeout=timeout_s) as resp:
                c = parse_counters(resp.read().decode())
        except (OSError, ValueError):
            c = EngineCounters()
        try:
            with urllib.request.urlopen(e.url + "/sim/state", timeout=timeout_s) as resp:
                st = json.loads(resp.read())
            c = replace(
                c,
                busy_seconds=float(st.get("busy_seconds", 0.0)),
                preemptions=float(st.get("preemptions", 0.0)),
            )
        except (OSError, ValueError, AttributeError):
            pass
        out.append(c)
    return out


def delta(before: Sequence[EngineCounters], after: Sequence[EngineCounters]) -> dict[str, Any]:
    """Per-engine and total change of the counters between two scrapes."""
    per = [
        EngineCounters(
            a.prefix_cache_queries - b.prefix_cache_queries,
            a.prefix_cache_hits - b.prefix_cache_hits,
            a.requests_ok - b.requests_ok,
            a.busy_seconds - b.busy_seconds,
            a.preemptions - b.preemptions,
        )
        for b, a in zip(before, after, strict=True)
    ]
    return {
        "engine_prompt_tokens": int(sum(p.prefix_cache_queries for p in per)),
        "engine_cached_tokens": int(sum(p.prefix_cache_hits for p in per)),
        "per_engine_requests": [int(p.requests_ok) for p in per],
        "per_engine_cached_tokens": [int(p.prefix_cache_hits) for p in per],
        "per_engine_busy_s": [round(p.busy_seconds, 2) for p in per],
        "preemptions": int(sum(p.preemptions for p in per)),
    }
