"""Record routing-decision inputs and outputs on a seeded benchmark trace (the fixture the
replay test compares against).

    PYTHONPATH=. python -m tests.routing.record_decisions [--out PATH]

A seeded `kvroute.testbed.workload` trace (chat, agent and hot-prefix burst sessions, a few
hundred requests) is routed over a synthetic 4-worker fleet, once per (model profile, policy
configuration) run. The fleet state is deterministic: a real `FleetIndexView` whose workers
declare the profile's KV groups (dense, sliding window, Mamba) and are credited with every
prompt routed to them (the router's own expectations, with the junction coverage); each
worker's own in-flight load (prefill done and request finished at times set by a fixed true
prefill rate and step period); and engine scrapes every second on three of the four workers
that add another replica's traffic from a seeded generator.
Every decision's inputs and the decision (chosen worker, reason, detail, each candidate's
predicted reuse, load and estimated TTFT) go to `tests/routing/fixtures/decisions.json.gz`.
The decision is made by replaying the recorded input (`decision_replay.Replayer`), so what is
saved is exactly what the replay test recomputes.
"""

from __future__ import annotations

import argparse
import gzip
import heapq
import json
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvroute.proto import events_pb2
from kvroute.router.fleet.load import PromptSizeEstimate
from kvroute.router.routing.fleet_index_view import FleetIndexView
from kvroute.router.routing.prefix_sharing import PrefixSharing
from kvroute.sim.profiles import PROFILES
from kvroute.testbed.textgen import TokenSpace
from kvroute.testbed.workload import AgentSpec, BurstSpec, ChatSpec, WorkloadSpec, generate
from tests.routing.decision_replay import FIXTURE, Replayer, decision_json

COMMAND = "PYTHONPATH=. python -m tests.routing.record_decisions"
WORKERS = ("w0", "w1", "w2", "w3")
TRUE_PREFILL_TOKENS_PER_S = 9000.0  # slower than the configured 20000: queues build
STEP_PERIOD_S = (0.018, 0.024, 0.030, 0.036)
SCRAPED = (True, True, True, False)  # w3 exposes no /metrics
SCRAPE_EVERY_S = 1.0
EXPECT_S = 30.0
MAX_REQUESTS = 300

SPEC = WorkloadSpec(
    seed=11,
    duration_s=12.0,
    tenants=5,
    chat=ChatSpec(sessions=56, turns=(2, 7), think_time_s=1.5),
    agent=AgentSpec(sessions=5, turns=(6, 20), tool_time_s=0.4, max_context_tokens=6000),
    burst=BurstSpec(bursts=3, size=8, prefix_tokens=(1200, 3000), window_s=0.8),
)

# Configurations replayed: the defaults, and one that turns on what the defaults leave off
# or rarely reach (tight saturation and spill, the other queue and junction rules)
TUNED: dict[str, Any] = {
    "saturation_queue_s": 0.08,
    "max_running_per_worker": 10,
    "kv_usage_saturation": 0.9,
    "full_queue_without_reuse": False,
    "junction_shared_only": False,
}
RUNS: list[tuple[str, str, dict[str, Any]]] = [
    *((p, "ttft", {}) for p in ("dense", "swa", "mamba")),
    *((p, "ttft-tuned", TUNED) for p in ("dense", "swa", "mamba")),
    *((p, "full_attention_only", {"name": "full_attention_only"}) for p in ("swa", "mamba")),
    ("dense", "session", {"name": "session"}),
    ("dense", "least_load", {"name": "least_load"}),
    ("dense", "round_robin", {"name": "round_robin"}),
    ("dense", "random", {"name": "random", "seed": 7}),
]

_ROLE = {"system": 1, "user": 2, "assistant": 3}


def token_ids(messages: Sequence[dict[str, str]]) -> list[int]:
    """A deterministic stand-in for a chat template: a role marker, then one id per word."""
    out: list[int] = []
    for m in messages:
        out.append(_ROLE.get(m["role"], 4))
        out.extend(zlib.crc32(w.encode()) % 60_000 + 100 for w in m["content"].split())
    return out


def groups_snapshot(profile: str, worker: int) -> events_pb2.Snapshot:
    """One STORE per KV group of the profile (of a prefix no request has), so the index knows
    the worker's layout from the start."""
    op = events_pb2.KvGroupEvent
    tokens = [50_000 + worker] * 128
    events = []
    for gid, g in enumerate(PROFILES[profile]):
        hashes = [(worker << 32 | gid << 16 | b).to_bytes(8, "big") for b in range(128 // 64)]
        if g.block_size == 16:
            hashes = [(worker << 32 | gid << 16 | b).to_bytes(8, "big") for b in range(8)]
        events.append(
            op(
                operation=op.STORE,
                group_id=gid,
                block_hashes=hashes,
                token_ids=tokens,
                block_size=g.block_size,
                kind=g.kind,
                sliding_window=g.sliding_window or 0,
            )
        )
    return events_pb2.Snapshot(sequence=1, has_sequence=True, events=events, stream_id="s")


@dataclass
class _Own:
    """A worker's requests from this router: running, prefilling, their queued tokens."""

    running: int = 0
    prefilling: int = 0
    queued: int = 0
    engine: list[Any] | None = None


@dataclass(order=True)
class _Event:
    at: float
    seq: int
    kind: str = field(compare=False)  # "prefilled" | "finished"
    worker: int = field(compare=False)
    tokens: int = field(compare=False, default=0)


class _Fleet:
    def __init__(self, seed: int) -> None:
        self.own = [_Own() for _ in WORKERS]
        self.events: list[_Event] = []
        self.seq = 0
        self.rng = random.Random(seed)
        self.next_scrape = 0.0

    def advance(self, now: float) -> None:
        while True:
            due = self.events[0].at if self.events else float("inf")
            if self.next_scrape <= now and self.next_scrape <= due:
                self._scrape(self.next_scrape)
                self.next_scrape += SCRAPE_EVERY_S
            elif due <= now:
                e = heapq.heappop(self.events)
                o = self.own[e.worker]
                if e.kind == "prefilled":
                    o.prefilling -= 1
                    o.queued -= e.tokens
                else:
                    o.running -= 1
            else:
                return

    def _scrape(self, at: float) -> None:
        for i, o in enumerate(self.own):
            if not SCRAPED[i]:
                continue
            others_running = self.rng.randint(0, 6)
            others_waiting = self.rng.randint(0, 2)
            kv = min(0.995, 0.35 + 0.045 * (o.running + others_running) + self.rng.random() / 10)
            o.engine = [
                float(o.running - o.prefilling + others_running),
                float(o.prefilling + others_waiting),
                round(kv, 4),
                at,
                o.running,
                o.prefilling,
            ]

    def dispatch(self, now: float, w: int, uncached: int, max_tokens: int) -> None:
        o = self.own[w]
        done = now + (o.queued + uncached) / TRUE_PREFILL_TOKENS_PER_S
        o.running += 1
        o.prefilling += 1
        o.queued += uncached
        self._push(done, "prefilled", w, uncached)
        self._push(done + max_tokens * STEP_PERIOD_S[w], "finished", w)

    def _push(self, at: float, kind: str, w: int, tokens: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, _Event(at, self.seq, kind, w, tokens))

    def loads(self, now: float) -> list[list[Any]]:
        return [[o.running, o.prefilling, o.queued, o.engine] for o in self.own]


def record_run(profile: str, scenario: str, config: dict[str, Any]) -> dict[str, Any]:
    space = TokenSpace.fallback()
    trace = generate(SPEC, space)[:MAX_REQUESTS]
    clock = [0.0]
    index = FleetIndexView(16, clock=lambda: clock[0])
    for i, name in enumerate(WORKERS):
        index.apply_snapshot(name, groups_snapshot(profile, i))
    replayer = Replayer(config, WORKERS)
    cfg = replayer.cfg
    fa_only = cfg.name == "full_attention_only"
    sharing = (
        PrefixSharing(cfg.hash_unit, cfg.sharing_max_keys)
        if cfg.junction_shared_only and cfg.affinity_weight > 0 and cfg.name == "ttft"
        else None
    )
    fleet = _Fleet(zlib.crc32(f"{profile}/{scenario}".encode()))
    mean = PromptSizeEstimate(cfg.avg_prompt_tokens)
    decisions = []
    for k, tr in enumerate(trace):
        now = tr.t
        clock[0] = now
        fleet.advance(now)
        assert tr.messages is not None
        ids = token_ids(tr.messages)
        salt = tr.cache_salt or ""
        keys = index.prompt_keys(ids, "", salt)
        coverage: dict[str, int] | None = None
        if fa_only:
            scores = {n: e.full_attention_only() for n, e in index.explain(ids, "", salt).items()}
        else:
            got, cov = index.reach(ids, "", salt, keys)
            scores, coverage = dict(got), dict(cov)
        # every 5th request carries no session key; every 23rd is a retry without one worker
        session = tr.user if zlib.crc32(tr.id.encode()) % 5 else None
        eligible = [i for i in range(len(WORKERS)) if k % 23 != 22 or i != k % len(WORKERS)]
        own_from = None
        if sharing is not None and coverage:
            own_from = sharing.own_from(keys, session if session is not None else object())
        inp = {
            "t": now,
            "n": len(ids),
            "reuse": [scores.get(n) for n in WORKERS],
            "cov": [coverage.get(n) for n in WORKERS] if coverage else None,
            "own": own_from,
            "session": session,
            "eligible": eligible,
            "mean": mean.value,
            "loads": fleet.loads(now),
        }
        d = replayer.decide(inp)
        assert d.chosen is not None
        w = WORKERS.index(d.chosen.name)
        if sharing is not None and coverage:
            sharing.note(keys, session if session is not None else object())
        mean.observe(d.chosen.uncached)
        junction = (coverage or {}).get(d.chosen.name) or 0
        index.expect(d.chosen.name, ids, "", salt, EXPECT_S, keys, junction)
        fleet.dispatch(now, w, d.chosen.uncached, tr.max_tokens)
        decisions.append({"input": inp, "output": decision_json(d)})
    return {
        "profile": profile,
        "scenario": scenario,
        "config": config,
        "workers": list(WORKERS),
        "decisions": decisions,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=FIXTURE)
    args = ap.parse_args(argv)
    data = {
        "recorded_with": COMMAND,
        "about": "routing decision inputs and outputs; see tests/routing/record_decisions.py",
        "runs": [record_run(p, s, c) for p, s, c in RUNS],
    }
    raw = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as gz:
        gz.write(raw)
    print(f"{args.out}: {len(data['runs'])} runs, {len(raw)} bytes JSON")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
