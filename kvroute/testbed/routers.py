"""The routers a benchmark can put in front of a fleet, and how to start each one.

Every router runs as its own process on loopback, in the benchmark's process group:

- ``kvroute serve --config FLEET_CONFIG --policy P`` (kvroute's policies),
- ``smg launch --worker-urls ... --policy P`` and ``vllm-router --worker-urls ... --policy P``
  from ``.venv-peers`` (text-based cache-aware or round robin; no KV events, since they do
  not read the simulated engines' event format the way kvroute's bridges do),
- ``python -m bench.proxy --policy P`` (the bench's yardsticks: oracle, naive prefix, ...).

In front of a prefill/decode fleet (``RouterSpec.pd``): the peers' P/D modes,
``vllm-router --vllm-pd-disaggregation`` and ``smg launch --pd-disaggregation``, given the
prefill and decode engines apart (``--prefill URL ... --decode URL ...``), and the bench
proxy's round-robin P/D relay; kvroute needs nothing more than the fleet's config, which
gives each worker its role.

A router is ready when its ``/v1/models`` lists the fleet's model.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import secrets
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.testbed.peers import Peers
from kvroute.testbed.procs import Child, ProcessGroup, free_port
from kvroute.testbed.sim_fleet import Fleet


@dataclass(frozen=True)
class RouterSpec:
    name: str  # key in results
    label: str  # row label in tables
    kind: str  # kvroute | smg | vllm-router | proxy
    policy: str
    env: tuple[tuple[str, str], ...] = ()  # extra environment (kvroute: KVROUTE_* settings)
    # its bridges' scheduling class, "idle" or "nice" (None: the bench's --bridge-sched)
    bridge_sched: str | None = None
    # a prefill/decode router: given the fleet's prefill and decode pools apart, it runs each
    # request's prefill on one and its decode on the other (kvroute does so on its own when
    # the fleet's config gives the workers those roles)
    pd: bool = False


ROUTERS: dict[str, RouterSpec] = {
    s.name: s
    for s in [
        RouterSpec("kvroute", "kvroute (default)", "kvroute", "ttft"),
        RouterSpec(
            "kvroute-fa-only", "kvroute full-attention only", "kvroute", "full_attention_only"
        ),
        RouterSpec(
            "kvroute-placement",
            "kvroute (default + placement by working set)",
            "kvroute",
            "ttft",
            (("KVROUTE_POLICY__PLACEMENT_WEIGHT", "1"),),
        ),
        RouterSpec(
            "kvroute-no-apply-delay",
            "kvroute (default, events applied at once)",
            "kvroute",
            "ttft",
            (("KVROUTE_EVENTS__APPLY_DELAY_S", "0"),),
        ),
        RouterSpec(
            "kvroute-no-metrics",
            "kvroute (default, engines' /metrics not read)",
            "kvroute",
            "ttft",
            (("KVROUTE_LOAD__METRICS_INTERVAL_S", "0"),),
        ),
        RouterSpec(
            "kvroute-weighted-cold-queue",
            "kvroute (default, cold queues at queue_weight, the earlier rule)",
            "kvroute",
            "ttft",
            (("KVROUTE_POLICY__FULL_QUEUE_WITHOUT_REUSE", "false"),),
        ),
        RouterSpec(
            "kvroute-bridges-nice",
            "kvroute (default, bridges at nice 10, the earlier placement)",
            "kvroute",
            "ttft",
            bridge_sched="nice",
        ),
        RouterSpec(
            "kvroute-chat-upstream",
            "kvroute (default, prompts sent as the client wrote them: engines tokenize them again)",
            "kvroute",
            "ttft",
            (("KVROUTE_MODELS__KVROUTE-SIM__SEND_TOKEN_IDS", "false"),),
        ),
        RouterSpec(
            "kvroute-no-answer-cache",
            "kvroute (default, answers not encoded ahead: each turn encodes the last answer)",
            "kvroute",
            "ttft",
            (("KVROUTE_TOKENIZER__REMEMBER_ANSWERS", "false"),),
        ),
        RouterSpec(
            "kvroute-cold-hash",
            "kvroute (default, cold requests on the session hash at any load, the earlier rule)",
            "kvroute",
            "ttft",
            (("KVROUTE_POLICY__SESSION_SLACK_TOKENS", "1000000000000"),),
        ),
        RouterSpec(
            "kvroute-configured-release",
            "kvroute (default, queued prefill released at the configured rate, the earlier rule)",
            "kvroute",
            "ttft",
            (("KVROUTE_LOAD__RELEASE_AT_MEASURED_RATE", "false"),),
        ),
        RouterSpec(
            "kvroute-no-queue-saturation",
            "kvroute (default, no worker saturated by its queued prefill: no spill for a queue)",
            "kvroute",
            "ttft",
            (("KVROUTE_POLICY__SATURATION_QUEUE_S", "1000000000"),),
        ),
        RouterSpec(
            "kvroute-true-rate",
            "kvroute (default, told the simulated fleet's true prefill rate, 5,600 tokens/s)",
            "kvroute",
            "ttft",
            (("KVROUTE_POLICY__PREFILL_TOKENS_PER_S", "5600"),),
        ),
        RouterSpec(
            "kvroute-learned-rate",
            "kvroute (default, routing with the prefill rate measured from first bytes)",
            "kvroute",
            "ttft",
            (("KVROUTE_POLICY__LEARN_PREFILL_RATE", "true"),),
        ),
        RouterSpec(
            "kvroute-junction-any-prefix",
            "kvroute (default, junction credit 0.5 for any covered prefix, the earlier rule)",
            "kvroute",
            "ttft",
            (
                ("KVROUTE_POLICY__JUNCTION_SHARED_ONLY", "false"),
                ("KVROUTE_POLICY__AFFINITY_WEIGHT", "0.5"),
            ),
        ),
        RouterSpec(
            "kvroute-gpu-only",
            "kvroute (default, no credit for CPU-tier KV: its tokens priced as prefill)",
            "kvroute",
            "ttft",
            # a CPU-tier token costs what prefilling it costs (policy.prefill_tokens_per_s's
            # default), so only GPU reuse draws a request
            (("KVROUTE_POLICY__CPU_TIER_TOKENS_PER_S", "20000"),),
        ),
        RouterSpec(
            "kvroute-pd-running-2ms",
            "kvroute (default, 2 ms per running decode sequence, the earlier charge)",
            "kvroute",
            "ttft",
            (("KVROUTE_PD__RUNNING_S", "0.002"),),
        ),
        RouterSpec("kvroute-session", "kvroute session affinity", "kvroute", "session"),
        RouterSpec("kvroute-least-load", "kvroute least load", "kvroute", "least_load"),
        RouterSpec("kvroute-round-robin", "kvroute round robin", "kvroute", "round_robin"),
        RouterSpec("smg-cache-aware", "smg cache_aware", "smg", "cache_aware"),
        RouterSpec("smg-round-robin", "smg round_robin", "smg", "round_robin"),
        RouterSpec("vllm-router", "vllm-router cache_aware", "vllm-router", "cache_aware"),
        RouterSpec("oracle", "oracle (true engine caches)", "proxy", "oracle"),
        RouterSpec("bench-prefix", "naive text prefix (bench proxy)", "proxy", "prefix"),
        RouterSpec("bench-round-robin", "round robin (bench proxy)", "proxy", "round_robin"),
        RouterSpec(
            "vllm-router-pd", "vllm-router P/D, cache_aware", "vllm-router", "cache_aware", pd=True
        ),
        RouterSpec("smg-pd", "smg P/D, cache_aware", "smg", "cache_aware", pd=True),
        RouterSpec(
            "pd-round-robin", "P/D round robin (bench proxy)", "proxy", "round_robin", pd=True
        ),
        RouterSpec(
            "bench-session",
            "session affinity, consistent hash (bench proxy)",
            "proxy",
            "session_hash",
        ),
    ]
}


# kvroute's admin API is on (loopback only) so the bench can read prediction accuracy.
ADMIN_TOKEN = "bench-" + secrets.token_hex(8)


class RouterUnavailable(RuntimeError):
    """The router cannot run here (not installed, not built yet); the reason is the message."""


def kvroute_available() -> str | None:
    """None if ``kvroute serve`` can run in this checkout, else why not."""
    try:
        found = importlib.util.find_spec("kvroute.router.cli") is not None
    except ImportError:
        found = False
    return None if found else "the kvroute router (kvroute/router/cli.py) is not in this checkout"


def _kvroute_command(spec: RouterSpec, port: int, fleet: Fleet, peers: Peers) -> list[str]:
    why = kvroute_available()
    if why:
        raise RouterUnavailable(why)
    return [
        sys.executable, "-m", "kvroute", "serve", "--config", str(fleet.config_path),
        "--policy", spec.policy, "--host", "127.0.0.1", "--port", str(port),
        "--admin-token", ADMIN_TOKEN, "--log-level", "warning",
    ]  # fmt: skip


def _pools(fleet: Fleet) -> tuple[list[str], list[str]]:
    """The URLs of a prefill/decode fleet's prefill engines and decode engines."""
    prefill = [e.url for e in fleet.engines if e.role == "prefill"]
    decode = [e.url for e in fleet.engines if e.role == "decode"]
    if not prefill or not decode:
        raise RouterUnavailable("a P/D router needs a fleet with prefill and decode engines")
    return prefill, decode


@dataclass(frozen=True)
class _PeerRouter:
    """A peer router from .venv-peers: smg and vllm-router take the same flags but three."""

    binary: Callable[[Peers], Path | None]  # its executable, if installed
    subcommand: tuple[str, ...]
    log_level: str
    pd_flag: str  # what turns its prefill/decode mode on

    def __call__(self, spec: RouterSpec, port: int, fleet: Fleet, peers: Peers) -> list[str]:
        path = self.binary(peers)
        if path is None:
            raise RouterUnavailable(peers.note or f"{spec.kind} not installed")
        if spec.pd:  # each prefill URL without a bootstrap port: vLLM's NIXL needs none
            prefill, decode = _pools(fleet)
            workers = [self.pd_flag]
            workers += [arg for url in prefill for arg in ("--prefill", url)]
            workers += [arg for url in decode for arg in ("--decode", url)]
        else:
            workers = ["--worker-urls", *(e.url for e in fleet.engines)]
        return [
            str(path), *self.subcommand, "--host", "127.0.0.1", "--port", str(port),
            *workers, "--policy", spec.policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--log-level", self.log_level,
        ]  # fmt: skip


def _proxy_command(spec: RouterSpec, port: int, fleet: Fleet, peers: Peers) -> list[str]:
    if spec.pd:
        prefill, decode = _pools(fleet)
        workers = ["--prefill", ",".join(prefill), "--decode", ",".join(decode)]
    else:
        workers = ["--engines", ",".join(e.url for e in fleet.engines)]
    return [
        sys.executable, "-m", "bench.proxy", "--policy", spec.policy, *workers,
        "--port", str(port),
    ]  # fmt: skip


# RouterSpec.kind -> the command line that starts such a router
_COMMANDS: dict[str, Callable[[RouterSpec, int, Fleet, Peers], list[str]]] = {
    "kvroute": _kvroute_command,
    "smg": _PeerRouter(lambda p: p.smg, ("launch",), "warn", "--pd-disaggregation"),
    "vllm-router": _PeerRouter(lambda p: p.vllm_router, (), "warning", "--vllm-pd-disaggregation"),
    "proxy": _proxy_command,
}


def command(spec: RouterSpec, port: int, fleet: Fleet, peers: Peers) -> list[str]:
    """The command line that starts ``spec`` on 127.0.0.1:``port`` in front of ``fleet``."""
    build = _COMMANDS.get(spec.kind)
    if build is None:
        raise ValueError(f"unknown router kind {spec.kind!r}")
    return build(spec, port, fleet, peers)


def kvroute_predictions(url: str) -> dict[str, Any] | None:
    """kvroute's own prediction accuracy (``/admin/workers``), summed over workers."""
    req = urllib.request.Request(
        url + "/admin/workers", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    try:
        with urllib.request.urlopen(req, timeout=5.0) as resp:
            workers = json.loads(resp.read())["workers"]
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return None
    verified = misses = resyncs = 0
    abs_err = 0.0
    for w in workers:
        p = w.get("prediction") or {}
        n = int(p.get("verified") or 0)
        verified += n
        misses += int(p.get("misses") or 0)
        resyncs += int(p.get("resyncs") or 0)
        abs_err += float(p.get("mean_abs_error_tokens") or 0.0) * n
    return {
        "verified": verified,
        "misses": misses,
        "resyncs": resyncs,
        "mean_abs_error_tokens": round(abs_err / verified, 2) if verified else None,
    }


def kvroute_decision_reasons(url: str) -> dict[str, int] | None:
    """kvroute's routing decisions by reason (its /metrics), e.g. {"cache": 250, "spill": 3}."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5.0) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError, UnicodeDecodeError):
        return None
    out: dict[str, int] = {}
    for line in text.splitlines():
        if not line.startswith("kvroute_routing_decisions_total{"):
            continue
        labels, _, value = line.rpartition(" ")
        reason = labels.split('reason="', 1)[1].split('"', 1)[0]
        out[reason] = out.get(reason, 0) + int(float(value))
    return out


# Enough for a whole benchmark trace, so every request's decision can be read after the run.
BENCH_DECISIONS_BUFFER = 10_000


def kvroute_decisions(url: str) -> list[dict[str, Any]] | None:
    """Every routing decision kvroute kept (``/admin/decisions``), oldest first, with the
    per-worker scores behind it."""
    req = urllib.request.Request(
        f"{url}/admin/decisions?limit={BENCH_DECISIONS_BUFFER}",
        headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30.0) as resp:
            found: list[dict[str, Any]] = json.loads(resp.read())["decisions"]
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return None
    return found


def _lists_model(url: str, model: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=2.0) as resp:
            data = json.loads(resp.read())
    # HTTPException: something not HTTP answered on the port before the router bound it (a
    # port another process took between free_port and the router's bind)
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        return False
    return any(m.get("id") == model for m in data.get("data") or [])


@dataclass(frozen=True)
class RunningRouter:
    spec: RouterSpec
    url: str
    child: Child


def start_router(
    pg: ProcessGroup,
    spec: RouterSpec,
    fleet: Fleet,
    peers: Peers,
    timeout_s: float = 60.0,
    cpus: Sequence[int] | None = None,
) -> RunningRouter:
    """Start ``spec`` (on ``cpus`` only, when given) and wait until it serves the fleet's
    model."""
    port = free_port()
    env = dict(spec.env)
    if spec.kind == "kvroute":  # keep every decision of a trace (the default keeps 256)
        env.setdefault("KVROUTE_LIMITS__DECISIONS_BUFFER", str(BENCH_DECISIONS_BUFFER))
    child = pg.start(
        f"router-{spec.name}",
        command(spec, port, fleet, peers),
        env=env,
        cwd=Path.cwd(),
        cpus=cpus,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while not _lists_model(url, fleet.model):
        if child.popen.poll() is not None:
            raise RuntimeError(
                f"{spec.name} exited with {child.popen.returncode}:\n{child.tail(20)}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"{spec.name} not ready after {timeout_s}s:\n{child.tail(20)}")
        time.sleep(0.2)
    return RunningRouter(spec, url, child)
