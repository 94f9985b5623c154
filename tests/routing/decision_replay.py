"""Replay recorded routing-decision inputs through the policy and serialize what it decides.

A fixture (`fixtures/decisions.json.gz`, written by `tests/routing/record_decisions.py`)
holds runs: a policy configuration, a fleet of named workers, and a sequence of decision
inputs (the time, the request's `RouteInput`, each worker's load and engine scrape, the
mean prompt size, the eligible workers) with the decision the policy made on each.
`replay` rebuilds every input on fresh `Worker` objects, feeds the sequence to one policy
object (its session ring and rotation carry state from one decision to the next, as in the
router) and returns each decision serialized canonically, so a run's bytes can be compared
with the recorded ones.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvroute.router.config import BreakerConfig, PolicyConfig, WorkerSpec
from kvroute.router.fleet.load import EngineMetrics, WorkerLoad
from kvroute.router.fleet.workers import Worker, WorkerRegistry
from kvroute.router.routing.policy import Decision, LoadModel, RouteInput, make_policy

FIXTURE = Path(__file__).parent / "fixtures" / "decisions.json.gz"
STALE_AFTER_S = 5.0


def canonical(obj: Any) -> str:
    """One JSON line: sorted keys, no spaces, floats as Python's shortest exact repr."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def decision_json(d: Decision) -> dict[str, Any]:
    """What a decision is, for comparison: the choice, its reason and text, and every
    candidate's picture (reuse, load, estimated TTFT, saturation, junction tokens)."""
    return {
        "policy": d.policy,
        "chosen": d.chosen.name if d.chosen else None,
        "reason": d.reason,
        "detail": d.detail,
        "reuse": d.predicted_reuse,
        "session": d.session_key,
        "cands": [
            [
                c.name,
                c.reuse,
                c.uncached,
                c.running,
                c.queued_tokens,
                c.kv_usage,
                c.est_ttft_s,
                c.saturated,
                c.affinity,
            ]
            for c in d.candidates
        ],
    }


def load_state(row: Sequence[Any]) -> WorkerLoad:
    """A worker's load from a fixture row: [running, prefilling, queued prefill tokens,
    engine scrape or null]."""
    running, prefilling, queued, engine = row
    load = WorkerLoad(running=running, prefilling=prefilling, queued_prefill_tokens=queued)
    if engine is not None:
        load.engine = EngineMetrics(*engine)
    return load


class Replayer:
    """One policy object over one fleet, fed decision inputs in order."""

    def __init__(self, config: dict[str, Any], workers: Sequence[str]) -> None:
        self.cfg = PolicyConfig(**config)
        self._mean = 1024.0
        self.load_model = LoadModel(self.cfg, lambda: self._mean, STALE_AFTER_S)
        self.policy = make_policy(self.cfg, self.load_model)
        registry = WorkerRegistry(BreakerConfig())
        self.workers = [
            registry.add(WorkerSpec(name=n, url=f"http://127.0.0.1:{9000 + i}"))
            for i, n in enumerate(workers)
        ]

    def decide(self, inp: dict[str, Any]) -> Decision:
        return self.policy.decide(*self.prepare(inp))

    def prepare(self, inp: dict[str, Any]) -> tuple[list[Worker], RouteInput, float]:
        """Set the fleet's state from a recorded input: the policy's arguments."""
        self._mean = inp["mean"]
        for w, row in zip(self.workers, inp["loads"], strict=True):
            w.load = load_state(row)
        names = [w.name for w in self.workers]
        reuse = dict(zip(names, inp["reuse"], strict=True)) if inp["reuse"] is not None else {}
        cov = inp["cov"]
        coverage = (
            {n: v for n, v in zip(names, cov, strict=True) if v is not None}
            if cov is not None
            else None
        )
        req = RouteInput(inp["n"], reuse, inp["session"], coverage, inp["own"])
        eligible: list[Worker] = [self.workers[i] for i in inp["eligible"]]
        return eligible, req, inp["t"]


def read_fixture(path: Path = FIXTURE) -> dict[str, Any]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def replay(run: dict[str, Any]) -> Iterator[str]:
    """Each recorded input of `run` through the current policy, as canonical JSON lines."""
    r = Replayer(run["config"], run["workers"])
    for step in run["decisions"]:
        yield canonical(decision_json(r.decide(step["input"])))
