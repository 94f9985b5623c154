"""Faults on demand: what an operator (or a test) can break in one simulated engine.

POST /sim/faults with any of:
  fail_next: int        the next N generation requests fail (HTTP 500, vLLM error shape)
  fail_rate: float      each generation request fails with this probability (seeded RNG)
  fail_mode: "http" | "stream"   fail before answering, or mid-stream after the first token
  slowdown: float       multiply every step's GPU time (1 = normal)
  hang: bool            stop answering (API requests wait; the engine stops stepping)
  drop_batches: int     drop the next N event batches from the PUB socket (a seq gap)
  drop_from_replay: bool  ... and from the replay buffer too (the gap cannot be replayed)
  malformed: "payload" | "frames"   send one malformed message on the PUB socket
  replay: bool          answer (true) or ignore (false) replay requests
  restart: bool         restart the engine: requests fail, cache empty, seq back to 0
  reset_prefix_cache: bool   vLLM's reset (AllBlocksCleared if no block is in use)
GET /sim/faults returns the current settings and counters.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

from sim.api.errors import bad_request

FAIL_MODES = ("http", "stream")
MALFORMED_KINDS = ("payload", "frames")


@dataclass
class FailurePlan:
    fail_next: int = 0
    fail_rate: float = 0.0
    fail_mode: str = "http"
    failed: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def take(self) -> str | None:
        """Whether this request fails, and how ("http" | "stream"), or None."""
        fail = False
        if self.fail_next > 0:
            self.fail_next -= 1
            fail = True
        elif self.fail_rate > 0 and self._rng.random() < self.fail_rate:
            fail = True
        if fail:
            self.failed += 1
            return self.fail_mode
        return None

    def state(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("seed")
        return d


def _num(body: dict[str, Any], key: str, kind: type, lo: float, hi: float | None) -> Any:
    value = body[key]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        ok = ok and isinstance(value, int)
    if not ok or value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise bad_request(f"{key} must be a {kind.__name__} {bound}", key)
    return kind(value)


def validate(body: Any) -> dict[str, Any]:
    """Check a POST /sim/faults body; returns the normalised settings to apply."""
    if not isinstance(body, dict):
        raise bad_request("faults body must be a JSON object")
    known = {
        "fail_next", "fail_rate", "fail_mode", "slowdown", "hang", "drop_batches",
        "drop_from_replay", "malformed", "replay", "restart", "reset_prefix_cache",
    }  # fmt: skip
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_request(f"unknown fault settings: {', '.join(unknown)}", unknown[0])
    out: dict[str, Any] = {}
    if "fail_next" in body:
        out["fail_next"] = _num(body, "fail_next", int, 0, None)
    if "fail_rate" in body:
        out["fail_rate"] = _num(body, "fail_rate", float, 0.0, 1.0)
    if "slowdown" in body:
        out["slowdown"] = _num(body, "slowdown", float, 0.001, None)
    if "drop_batches" in body:
        out["drop_batches"] = _num(body, "drop_batches", int, 0, None)
    if "fail_mode" in body:
        if body["fail_mode"] not in FAIL_MODES:
            raise bad_request(f"fail_mode must be one of {FAIL_MODES}", "fail_mode")
        out["fail_mode"] = body["fail_mode"]
    if "malformed" in body:
        if body["malformed"] not in MALFORMED_KINDS:
            raise bad_request(f"malformed must be one of {MALFORMED_KINDS}", "malformed")
        out["malformed"] = body["malformed"]
    for key in ("hang", "drop_from_replay", "replay", "restart", "reset_prefix_cache"):
        if key in body:
            if not isinstance(body[key], bool):
                raise bad_request(f"{key} must be a boolean", key)
            out[key] = body[key]
    return out
