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
from typing import Any, Final

from kvroute.sim.api.errors import bad_request
from kvroute.sim.publisher import MALFORMED_KINDS

FAIL_MODES = ("http", "stream")


@dataclass
class FailurePlan:
    """Which generation requests fail, and how (the fail_* settings and their count)."""

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
        """The settings and the failure count, as GET /sim/faults reports them."""
        d = asdict(self)
        d.pop("seed")
        return d


# (setting, type, lowest, highest or None) of the numeric settings.
_NUMBERS: Final = (
    ("fail_next", int, 0, None),
    ("fail_rate", float, 0.0, 1.0),
    ("slowdown", float, 0.001, None),
    ("drop_batches", int, 0, None),
)
_CHOICES: Final = {"fail_mode": FAIL_MODES, "malformed": MALFORMED_KINDS}
_FLAGS: Final = ("hang", "drop_from_replay", "replay", "restart", "reset_prefix_cache")
_KNOWN: Final = {name for name, *_ in _NUMBERS} | set(_CHOICES) | set(_FLAGS)


def _number(key: str, value: Any, kind: type, lo: float, hi: float | None) -> int | float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        ok = ok and isinstance(value, int)
    if not ok or value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise bad_request(f"{key} must be a {kind.__name__} {bound}", key)
    return int(value) if kind is int else float(value)


def validate(body: Any) -> dict[str, Any]:
    """Check a POST /sim/faults body; returns the normalised settings to apply."""
    if not isinstance(body, dict):
        raise bad_request("faults body must be a JSON object")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise bad_request(f"unknown fault settings: {', '.join(unknown)}", unknown[0])
    out: dict[str, Any] = {}
    for key, kind, lo, hi in _NUMBERS:
        if key in body:
            out[key] = _number(key, body[key], kind, lo, hi)
    for key, choices in _CHOICES.items():
        if key in body:
            if body[key] not in choices:
                raise bad_request(f"{key} must be one of {choices}", key)
            out[key] = body[key]
    for key in _FLAGS:
        if key in body:
            if not isinstance(body[key], bool):
                raise bad_request(f"{key} must be a boolean", key)
            out[key] = body[key]
    return out
