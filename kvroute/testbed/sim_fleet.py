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
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvroute.testbed.procs import Child, ProcessGroup, wait_http


@dataclass(frozen=True)
class Engine:
    name: str
    url: str
    role: str = "both"  # both, prefill or decode (a prefill/decode fleet's pools)


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
    pd: tuple[int, int] | None = None,
) -> Fleet:
    """Start a fleet and wait until every engine answers; raises :class:`FleetError`.

    ``python`` runs the fleet with another interpreter (vLLM's, for ``--cache-backend vllm``),
    with this checkout on its path. ``cpus``: the engines and bridges run only there. ``pd``
    (prefill, decode): that many prefill-only and decode-only engines besides the ``workers``
    mixed ones (``kvroute sim fleet --prefill P --decode D``).
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
    if pd is not None:
        cmd += ["--prefill", str(pd[0]), "--decode", str(pd[1])]
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
        engines = tuple(
            Engine(str(w["name"]), str(w["url"]).rstrip("/"), str(w.get("role") or "both"))
            for w in cfg["workers"]
        )
        for e in engines:
            wait_http(e.url + "/health", max(1.0, deadline - time.monotonic()), child.popen)
        model = next((str(w["model"]) for w in cfg["workers"] if w.get("model")), None)
        model = model or _served_model(engines[0].url)
    except (FleetError, TimeoutError, RuntimeError, OSError, KeyError, TypeError) as exc:
        raise FleetError(f"{exc}\n--- fleet log ---\n{child.tail(30)}") from None
    return Fleet(profile, engines, model, config, child)


# The outcomes of a simulated decode's pull that leave it to compute the prompt itself
# (kvroute/sim/engine/kv_transfer.py).
PULL_FAILURES = ("invalid", "gone", "unreachable")


@dataclass(frozen=True)
class EngineCounters:
    """Cumulative counters of one engine."""

    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    requests_ok: float = 0.0
    busy_seconds: float = 0.0  # simulated GPU time (sim-only, from /sim/state)
    preemptions: float = 0.0  # sim-only, from /sim/state
    # prefill/decode: pulls this engine made as a decode (any outcome) and the KV blocks they
    # moved, and the prefills whose blocks it kept for a decode (sim-only, /sim/state)
    kv_pulls: float = 0.0
    kv_blocks_pulled: float = 0.0
    kv_leases: float = 0.0
    # pulls that brought nothing (the producer no longer held the blocks, could not be reached,
    # or the params were incomplete: the decode computed the prompt) and leases that ran out
    kv_pull_failures: float = 0.0
    kv_leases_expired: float = 0.0


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
            kv = st.get("kv_transfer") or {}
            c = replace(
                c,
                busy_seconds=float(st.get("busy_seconds", 0.0)),
                preemptions=float(st.get("preemptions", 0.0)),
                kv_pulls=float(sum((kv.get("pulls") or {}).values())),
                kv_blocks_pulled=float(kv.get("blocks_pulled", 0.0)),
                kv_leases=float(kv.get("leases_granted", 0.0)),
                kv_pull_failures=float(
                    sum(n for k, n in (kv.get("pulls") or {}).items() if k in PULL_FAILURES)
                ),
                kv_leases_expired=float(kv.get("leases_expired", 0.0)),
            )
        except (OSError, ValueError, AttributeError):
            pass
        out.append(c)
    return out


def delta(before: Sequence[EngineCounters], after: Sequence[EngineCounters]) -> dict[str, Any]:
    """Per-engine and total change of the counters between two scrapes."""
    names = [f.name for f in fields(EngineCounters)]
    per = [
        EngineCounters(**{n: getattr(a, n) - getattr(b, n) for n in names})
        for b, a in zip(before, after, strict=True)
    ]
    return {
        "engine_prompt_tokens": int(sum(p.prefix_cache_queries for p in per)),
        "engine_cached_tokens": int(sum(p.prefix_cache_hits for p in per)),
        "per_engine_requests": [int(p.requests_ok) for p in per],
        "per_engine_prompt_tokens": [int(p.prefix_cache_queries) for p in per],
        "per_engine_cached_tokens": [int(p.prefix_cache_hits) for p in per],
        "per_engine_busy_s": [round(p.busy_seconds, 2) for p in per],
        "per_engine_kv_pulls": [int(p.kv_pulls) for p in per],
        "per_engine_kv_blocks_pulled": [int(p.kv_blocks_pulled) for p in per],
        "per_engine_kv_leases": [int(p.kv_leases) for p in per],
        "per_engine_kv_pull_failures": [int(p.kv_pull_failures) for p in per],
        "per_engine_kv_leases_expired": [int(p.kv_leases_expired) for p in per],
        "preemptions": int(sum(p.preemptions for p in per)),
    }


def pd_pools(engines: Sequence[Engine], row: dict[str, Any], answered: int) -> dict[str, Any]:
    """A prefill/decode run's counters by pool, from a :func:`delta` row of those engines and
    the number of requests the client got answered: each pool's prompt and cached tokens,
    requests and simulated GPU seconds, the decode pool's pulls and the KV blocks they moved
    (in total and per answered request) and the pulls that brought nothing, and the prefills
    whose blocks were kept for a pull and the leases that ran out unpulled."""

    def total(key: str, role: str) -> float:
        return float(sum(v for e, v in zip(engines, row[key], strict=True) if e.role == role))

    out: dict[str, Any] = {}
    for role in ("prefill", "decode"):
        prompt = int(total("per_engine_prompt_tokens", role))
        cached = int(total("per_engine_cached_tokens", role))
        out[role] = {
            "engines": sum(1 for e in engines if e.role == role),
            "requests": int(total("per_engine_requests", role)),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "cached_ratio": round(cached / prompt, 4) if prompt else None,
            "busy_s": round(total("per_engine_busy_s", role), 2),
        }
    pulls = int(total("per_engine_kv_pulls", "decode"))
    blocks = int(total("per_engine_kv_blocks_pulled", "decode"))
    out["kv_leases"] = int(total("per_engine_kv_leases", "prefill"))
    out["kv_leases_expired"] = int(total("per_engine_kv_leases_expired", "prefill"))
    out["kv_pull_failures"] = int(total("per_engine_kv_pull_failures", "decode"))
    out["kv_pulls"] = pulls
    out["kv_blocks_pulled"] = blocks
    out["kv_pulls_per_request"] = round(pulls / answered, 4) if answered else None
    out["kv_blocks_per_request"] = round(blocks / answered, 2) if answered else None
    return out
