"""Resource exhaustion at the router's edge, against real processes on loopback: a
`kvroute serve` with small edge bounds in front of two `kvroute sim` engines, attacked with
slow uploads, streams nobody reads, connections that never finish a request and many large
bodies at once (kvroute/testbed/edge_attacks.py). For each attack: how fresh requests were
answered while it lasted, how long until one got 200, what the router counted; for the large
bodies the router's peak RSS with and without a budget of body bytes in flight, and whether
every admitted request was answered.

    python -m bench.edge_exhaustion_bench [--bodies 32] [--body-mib 8] [--out FILE]

Writes bench/results/2026-12-05-security-reliability/edge_exhaustion.json unless --out says
otherwise. Takes about half a minute.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kvroute.testbed import edge_attacks as atk
from kvroute.testbed.edge_target import MIB, Target, metric, sim_fleet, start_router, wait_metric
from kvroute.testbed.procs import ProcessGroup

OUT = Path(__file__).parent / "results" / "2026-12-05-security-reliability" / "edge_exhaustion.json"

# the attacked router's bounds: small, so a short run reaches each of them
ATTACKED = {
    "KVROUTE_LIMITS__MAX_IN_FLIGHT": "16",
    "KVROUTE_LIMITS__MAX_BODY_BYTES": str(9 * MIB),
    "KVROUTE_LIMITS__UPSTREAM_CONNECTIONS": "4",
    "KVROUTE_EDGE__BODY_BYTES_IN_FLIGHT": str(16 * MIB),
    "KVROUTE_EDGE__BODY_READ_S": "1.0",
    "KVROUTE_EDGE__POOL_WAIT_S": "1.0",
    "KVROUTE_EDGE__WRITE_STALL_S": "1.0",
    "KVROUTE_EDGE__LIMIT_CONCURRENCY": "64",
    "KVROUTE_EDGE__CLIENT_SEND_BUFFER_BYTES": "16384",
}
FRESH_DEADLINE_S = 5.0


def _bodies_router(budget: int) -> dict[str, str]:
    return {
        "KVROUTE_LIMITS__MAX_IN_FLIGHT": "64",
        "KVROUTE_LIMITS__MAX_BODY_BYTES": str(9 * MIB),
        "KVROUTE_LIMITS__UPSTREAM_CONNECTIONS": "16",
        "KVROUTE_EDGE__BODY_BYTES_IN_FLIGHT": str(budget),
        "KVROUTE_EDGE__BODY_READ_S": "20",
        "KVROUTE_EDGE__LIMIT_CONCURRENCY": "128",
    }


def _answers(answers: list[atk.Answer]) -> dict[str, Any]:
    return {
        "statuses": dict(Counter(str(a.status) for a in answers)),
        "max_s": round(max(a.seconds for a in answers), 3),
    }


def _fresh_during(target: Target) -> dict[str, Any]:
    """Fresh requests, one after another, while an attack lasts: how each was answered, and
    when the first got 200 (None: not within FRESH_DEADLINE_S)."""
    chat = target.url + "/v1/chat/completions"
    started = time.perf_counter()
    ok, answers = atk.first_ok_within(chat, atk.chat_body(target.model), FRESH_DEADLINE_S)
    return {
        "fresh_answers": _answers(answers),
        "first_200_s": round(time.perf_counter() - started, 3) if ok.status == 200 else None,
    }


def slow_uploads(target: Target, n: int) -> dict[str, Any]:
    with atk.slow_uploads(target.host, target.port, n, "/v1/chat/completions") as socks:
        result = _fresh_during(target)
        result["attack"] = dict(Counter(str(atk.answered(s, 3.0)) for s in socks))
    return {"connections": n, **result}


def unread_streams(target: Target, n: int, tokens: int) -> dict[str, Any]:
    kind = 'kind="write_stall"'
    before = metric(target.url, "kvroute_errors_total", kind)
    gone = metric(target.url, "kvroute_client_disconnects_total")
    with atk.unread_streams(target.host, target.port, n, target.model, tokens):
        result = _fresh_during(target)
        stalls = wait_metric(target.url, "kvroute_errors_total", kind, before + n // 2)
        result["attack"] = {
            "write_stalls": stalls - before,
            "client_disconnects": metric(target.url, "kvroute_client_disconnects_total") - gone,
        }
    return {"streams": n, "tokens_each": tokens, **result}


def connection_flood(target: Target, n: int) -> dict[str, Any]:
    chat = target.url + "/v1/chat/completions"
    body = atk.chat_body(target.model)
    kind = 'kind="concurrency_limit"'
    before = metric(target.url, "kvroute_errors_total", kind)
    with atk.idle_connections(target.host, target.port, n):
        during = [atk.post(chat, body, timeout_s=3.0) for _ in range(20)]
    started = time.perf_counter()
    ok, _ = atk.first_ok_within(chat, body, FRESH_DEADLINE_S)
    return {
        "connections": n,
        "fresh_answers": _answers(during),
        "first_200_after_s": round(time.perf_counter() - started, 3) if ok.status == 200 else None,
        "refusals_counted": metric(target.url, "kvroute_errors_total", kind) - before,
        "refusal_log_lines": target.log.read_text().count("Exceeded concurrency limit"),
    }


def large_bodies(target: Target, k: int, size: int, budget: int) -> dict[str, Any]:
    atk.large_bodies(target.host, target.port, 1, size, target.model)  # first-use costs
    ok_before = metric(target.url, "kvroute_requests_total", 'status="200"')
    atk.reset_peak(target.pid)
    base = atk.vm_kib(target.pid, "VmRSS")
    started = time.perf_counter()
    statuses = atk.large_bodies(target.host, target.port, k, size, target.model)
    seconds = time.perf_counter() - started
    peak = atk.vm_kib(target.pid)
    oversize = atk.large_bodies(target.host, target.port, 1, 10 * MIB, target.model)
    answered_ok = metric(target.url, "kvroute_requests_total", 'status="200"') - ok_before
    return {
        "bodies": k,
        "body_mib": size / MIB,
        "budget_mib": budget / MIB,
        "statuses": dict(Counter(str(s) for s in statuses)),
        "admitted": statuses.count(200),
        "admitted_answered_200": answered_ok,
        "unanswered": statuses.count(0),
        "seconds": round(seconds, 3),
        "rss_base_mib": round(base / 1024, 1),
        "rss_peak_mib": round(peak / 1024, 1),
        "rss_growth_mib": round((peak - base) / 1024, 1),
        "growth_per_budget": round((peak - base) * 1024 / budget, 2),
        "over_max_body_status": oversize[0],
    }


def run(k: int, size: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, ProcessGroup(Path(tmp)) as pg:
        run_dir = Path(tmp)
        fleet = sim_fleet(pg, run_dir)
        attacked = start_router(pg, fleet, run_dir, ATTACKED, "attacked")
        results: dict[str, Any] = {"limits": ATTACKED}
        results["slow_uploads"] = slow_uploads(attacked, 24)
        results["unread_streams"] = unread_streams(attacked, 8, 1500)
        results["connection_flood"] = connection_flood(attacked, 80)
        budget = 8 * size
        bounded = start_router(pg, fleet, run_dir, _bodies_router(budget), "bounded")
        results["large_bodies"] = large_bodies(bounded, k, size, budget)
        # the same bodies with a budget that holds all of them: what the budget saves
        whole = k * size + MIB
        unbounded = start_router(pg, fleet, run_dir, _bodies_router(whole), "unbounded")
        results["large_bodies_unbudgeted"] = large_bodies(unbounded, k, size, whole)
        return results


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.edge_exhaustion_bench", description=__doc__)
    p.add_argument("--bodies", type=int, default=32, help="large bodies sent at once")
    p.add_argument("--body-mib", type=int, default=8, help="size of each, MiB (< 9)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    results = run(args.bodies, args.body_mib * MIB)
    text = json.dumps(results, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
