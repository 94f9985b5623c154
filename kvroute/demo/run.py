"""One demo run: a fresh simulated fleet, the router with one policy, the trace, the numbers.

The processes are the bench's (:mod:`kvroute.testbed.sim_fleet`, :mod:`kvroute.testbed.routers`):
``kvroute sim
fleet`` (engines + bridges) and ``kvroute serve`` in front of it, each in its own process
group; the bench's launcher turns the router's admin API on with a random token (used for the
dashboard too). The demo adds to the fleet's router config the simulated engines' prefill
rate and the response headers naming the worker.

Measured, per run:
- from the engines: every response's ``usage.prompt_tokens_details.cached_tokens`` (the load
  generator's records) and the engines' prefix-cache counters before and after;
- from the load generator: TTFT percentiles and throughput;
- from the router's ``/metrics``: its predictions checked against what the engines reported;
- for cache-aware runs, after the traffic: each worker's predicted reuse for every session's
  last prompt (``/admin/score``), what an index of full-attention groups only would predict
  (same answer), and the engine's true hit (``/sim/probe``), side by side;
- on a prefill/decode fleet (``--pd``), instead of that probe: each pool's work from the
  engines' ``/sim/state`` (:mod:`kvroute.demo.pd`).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvroute.demo.pd import engine_states, pool_numbers
from kvroute.demo.workload import DemoSetup
from kvroute.testbed.loadgen import LoadConfig, build_body, run_trace
from kvroute.testbed.peers import Peers
from kvroute.testbed.procs import ProcessGroup
from kvroute.testbed.routers import ADMIN_TOKEN, ROUTERS, RunningRouter, start_router
from kvroute.testbed.sim_fleet import Fleet, delta, scrape, start_fleet
from kvroute.testbed.stats import RequestRecord, summarize
from kvroute.testbed.trace import TraceRequest

# Demo policy name -> the bench's router spec.
POLICIES = {"kvroute": "kvroute", "round_robin": "kvroute-round-robin"}
LABELS = {"kvroute": "kvroute (cache-aware)", "round_robin": "round robin"}
SLO_TTFT_S = 1.0


@dataclass
class RunResult:
    """What one run measured (JSON-ready through :meth:`to_json`)."""

    policy: str
    label: str
    summary: dict[str, Any]
    engine: dict[str, Any]
    prediction: dict[str, Any] | None
    hybrid: dict[str, Any] | None
    wall_s: float
    records: list[RequestRecord] = field(default_factory=list, repr=False)
    pd: dict[str, Any] | None = None  # each pool's work on a prefill/decode fleet

    @property
    def cached_share(self) -> float:
        return float(self.summary["cached_ratio"])

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "label": self.label,
            "summary": self.summary,
            "engine_counters": self.engine,
            "prediction": self.prediction,
            "hybrid_probe": self.hybrid,
            "pools": self.pd,
            "wall_s": self.wall_s,
        }


def _http_json(url: str, token: str | None = None, body: Any = None, timeout: float = 5.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    req.add_header("content-type", "application/json")
    if token:
        req.add_header("authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _http_text(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text: str = resp.read().decode()
        return text


def configure_router(fleet: Fleet, setup: DemoSetup) -> None:
    """Add the demo's settings to the router config the fleet wrote."""
    cfg: dict[str, Any] = yaml.safe_load(fleet.config_path.read_text()) or {}
    cfg["admin"] = {"response_headers": True}
    cfg.setdefault("policy", {})["prefill_tokens_per_s"] = setup.prefill_tokens_per_s
    cfg["log_level"] = "warning"
    fleet.config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def wait_events_live(url: str, token: str, workers: int, timeout_s: float = 20.0) -> None:
    """Wait until the router follows every worker's KV events (so its view starts complete)."""
    deadline = time.monotonic() + timeout_s
    while True:
        data = _http_json(url + "/admin/workers", token)
        live = [w for w in data["workers"] if (w.get("events") or {}).get("state") == "live"]
        if len(live) >= workers:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(live)} of {workers} event streams live")
        time.sleep(0.1)


def prediction_from_metrics(text: str) -> dict[str, Any] | None:
    """The router's checked predictions, summed over workers (None if it checked none)."""
    outcomes: dict[str, float] = {}
    sums = {"predicted": 0.0, "reported": 0.0, "abs_error": 0.0, "count": 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kvroute_prediction_outcomes_total":
                key = s.labels.get("outcome", "?")
                outcomes[key] = outcomes.get(key, 0.0) + s.value
            elif s.name == "kvroute_predicted_cached_tokens_total":
                sums["predicted"] += s.value
            elif s.name == "kvroute_reported_cached_tokens_total":
                sums["reported"] += s.value
            elif s.name == "kvroute_prediction_error_tokens_sum":
                sums["abs_error"] += s.value
            elif s.name == "kvroute_prediction_error_tokens_count":
                sums["count"] += s.value
    n = int(sums["count"])
    if n == 0:
        return None
    return {
        "verified": n,
        "exact": int(outcomes.get("exact", 0)),
        "over": int(outcomes.get("over", 0)),
        "under": int(outcomes.get("under", 0)),
        "tokenizer_mismatch": int(outcomes.get("tokenizer_mismatch", 0)),
        "predicted_tokens": int(sums["predicted"]),
        "reported_tokens": int(sums["reported"]),
        "mean_abs_error_tokens": round(sums["abs_error"] / n, 2),
        # Error relative to what the engines reported: the headline number.
        "abs_error_share": round(sums["abs_error"] / sums["reported"], 4)
        if sums["reported"]
        else 0.0,
    }


def probe_prompts(trace: Sequence[TraceRequest], limit: int) -> list[TraceRequest]:
    """Every session's last request (their prompts contain the whole conversation)."""
    last: dict[str, TraceRequest] = {}
    for r in trace:
        if r.session not in last or r.turn > last[r.session].turn:
            last[r.session] = r
    return sorted(last.values(), key=lambda r: r.session)[:limit]


async def _hybrid_probe(
    router_url: str, token: str, engines: dict[str, str], prompts: Sequence[TraceRequest]
) -> dict[str, Any]:
    cfg = LoadConfig(url=router_url, model="")
    pairs: list[tuple[int, int, int]] = []  # (truth, kvroute, full-attention-only)
    auth = {"authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        for req in prompts:
            body = build_body(req, cfg, req.messages)
            body["stream"] = False
            body.pop("stream_options", None)
            async with http.post(router_url + "/admin/score", json=body, headers=auth) as resp:
                score = await resp.json()
            for w in score.get("workers", []):
                url = engines.get(w["worker"])
                if url is None:
                    continue
                async with http.post(url + "/sim/probe", json=body) as resp:
                    truth = int((await resp.json())["cached_tokens"])
                predicted = int(w.get("predicted_reuse") or 0)
                fa_only = w.get("full_attention_only_reuse")
                pairs.append((truth, predicted, int(fa_only or 0)))
    n = len(pairs)
    if n == 0:
        return {"pairs": 0}
    exact = sum(1 for t, p, _ in pairs if p == t)
    fa_over = [f - t for t, _, f in pairs if f > t]
    return {
        "prompts": len(prompts),
        "pairs": n,
        "true_cached_tokens": sum(t for t, _, _ in pairs),
        "kvroute_predicted_tokens": sum(p for _, p, _ in pairs),
        "kvroute_exact_share": round(exact / n, 4),
        "kvroute_mean_abs_error_tokens": round(sum(abs(p - t) for t, p, _ in pairs) / n, 2),
        "full_attention_only_over_share": round(len(fa_over) / n, 4),
        "full_attention_only_mean_overstatement_tokens": round(sum(fa_over) / n, 1),
        "full_attention_only_predicted_tokens": sum(f for _, _, f in pairs),
    }


@dataclass
class LiveRun:
    """A running fleet and router (stop with :meth:`stop`)."""

    pg: ProcessGroup
    fleet: Fleet
    router: RunningRouter
    token: str
    policy: str
    roles: dict[str, str] = field(default_factory=dict)  # engine -> prefill/decode (P/D only)

    @property
    def url(self) -> str:
        return self.router.url

    def stop(self) -> None:
        self.pg.stop_all()


def start_live(setup: DemoSetup, policy: str, log_dir: Path) -> LiveRun:
    """A fresh fleet (cold caches) and the router with ``policy`` in front of it."""
    pg = ProcessGroup(log_dir)
    pools = ("--prefill", str(setup.prefill), "--decode", str(setup.decode)) if setup.pd else ()
    try:
        fleet = start_fleet(
            pg,
            workers=setup.workers,
            profile=setup.profile,
            run_dir=log_dir,
            extra_args=("--speed", str(setup.speed), *pools),
        )
        configure_router(fleet, setup)
        router = start_router(pg, ROUTERS[POLICIES[policy]], fleet, Peers(None, None))
        # The bench's launcher turns the admin API on with its per-process random token.
        wait_events_live(router.url, ADMIN_TOKEN, setup.engines)
    except BaseException:
        pg.stop_all()
        raise
    return LiveRun(pg, fleet, router, ADMIN_TOKEN, LABELS[policy], _roles(fleet))


def _roles(fleet: Fleet) -> dict[str, str]:
    """The prefill and decode engines of the fleet's router config (none on a mixed fleet)."""
    cfg: dict[str, Any] = yaml.safe_load(fleet.config_path.read_text()) or {}
    return {str(w["name"]): str(w["role"]) for w in cfg.get("workers", []) if w.get("role")}


def replay(
    live: LiveRun,
    policy: str,
    trace: Sequence[TraceRequest],
    on_done: Callable[[RequestRecord], None] | None = None,
    probe_limit: int = 40,
) -> RunResult:
    """Send the trace through the router and collect the run's numbers (processes stay up)."""
    t0 = time.monotonic()
    engines = live.fleet.engines
    before = scrape(engines)
    states = engine_states(engines) if live.roles else {}
    load = LoadConfig(url=live.url, model=live.fleet.model, request_timeout_s=60.0)
    records = asyncio.run(run_trace(trace, load, on_done))
    after = scrape(engines)
    pools = None
    if live.roles:
        ok = sum(1 for r in records if r.ok)
        pools = pool_numbers(states, engine_states(engines), live.roles, ok)
    prediction = prediction_from_metrics(_http_text(live.url + "/metrics"))
    hybrid = None
    if policy != "round_robin" and not live.roles:
        urls = {e.name: e.url for e in engines}
        prompts = probe_prompts(
            [replace(r, model=r.model or live.fleet.model) for r in trace], probe_limit
        )
        hybrid = asyncio.run(_hybrid_probe(live.url, live.token, urls, prompts))
    return RunResult(
        policy=policy,
        label=LABELS[policy],
        summary=summarize(records, SLO_TTFT_S).to_json(),
        engine=delta(before, after),
        prediction=prediction,
        hybrid=hybrid,
        wall_s=round(time.monotonic() - t0, 1),
        records=records,
        pd=pools,
    )
