"""`kvroute demo --pd`: what each pool of a prefill/decode fleet did in a run.

Read from the simulated engines' own ``/sim/state`` before and after the traffic:
- the prefill pool: prompt tokens it was given, how many it found in its prefix cache, and
  so how many it computed (what a cache-aware choice of prefill worker saves);
- the decode pool: the KV blocks it pulled from the prefill pool (vLLM's NIXL connector
  reads only the blocks a decode worker lacks), as tokens, per request; what it already held.
"""

from __future__ import annotations

import json
import math
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from kvroute.testbed.sim_fleet import Engine

PREFILL, DECODE = "prefill", "decode"


def engine_states(engines: Sequence[Engine], timeout_s: float = 5.0) -> dict[str, dict[str, Any]]:
    """Every engine's ``/sim/state``, by name."""
    out: dict[str, dict[str, Any]] = {}
    for e in engines:
        with urllib.request.urlopen(e.url + "/sim/state", timeout=timeout_s) as resp:
            out[e.name] = json.loads(resp.read())
    return out


def _block_tokens(state: Mapping[str, Any]) -> int:
    """Tokens per pulled block: vLLM's scheduler block, the LCM of the groups' block sizes."""
    return math.lcm(*(int(g["block_size"]) for g in state["groups"]))


def _change(before: Mapping[str, Any], after: Mapping[str, Any], *path: str) -> float:
    a: Any = after
    b: Any = before
    for key in path:
        a, b = a.get(key, {}), b.get(key, {})
    return float(a or 0) - float(b or 0)


def pool_numbers(
    before: Mapping[str, Mapping[str, Any]],
    after: Mapping[str, Mapping[str, Any]],
    roles: Mapping[str, str],
    requests: int,
) -> dict[str, Any]:
    """Both pools' work between two `engine_states` (see the module doc); `roles`: engine
    name -> prefill or decode; `requests`: the run's answered requests (the per-request
    divisor)."""
    prefill = {"prompt_tokens": 0, "cached_tokens": 0, "computed_tokens": 0, "busy_s": 0.0}
    decode = {"pulled_tokens": 0, "pulled_blocks": 0, "held_tokens": 0, "pulls": 0}
    per_engine: dict[str, dict[str, Any]] = {}
    for name, role in sorted(roles.items()):
        b, a = before[name], after[name]
        queries = int(_change(b, a, "prefix_cache_queries"))
        hits = int(_change(b, a, "prefix_cache_hits"))
        if role == PREFILL:
            prefill["prompt_tokens"] += queries
            prefill["cached_tokens"] += hits
            prefill["computed_tokens"] += queries - hits
            prefill["busy_s"] += _change(b, a, "busy_seconds")
            per_engine[name] = {"role": role, "computed_tokens": queries - hits}
        elif role == DECODE:
            blocks = int(_change(b, a, "kv_transfer", "blocks_pulled"))
            pulls = sum(a["kv_transfer"]["pulls"].values()) - sum(
                b.get("kv_transfer", {}).get("pulls", {}).values()
            )
            decode["pulled_blocks"] += blocks
            decode["pulled_tokens"] += blocks * _block_tokens(a)
            decode["held_tokens"] += hits
            decode["pulls"] += pulls
            per_engine[name] = {"role": role, "pulls": pulls, "pulled_blocks": blocks}
    prefill["busy_s"] = round(float(prefill["busy_s"]), 2)
    prompt = prefill["prompt_tokens"]
    return {
        "prefill": {
            **prefill,
            "cached_share": round(prefill["cached_tokens"] / prompt, 4) if prompt else 0.0,
        },
        "decode": {
            **decode,
            "pulled_tokens_per_request": round(decode["pulled_tokens"] / requests, 1)
            if requests
            else 0.0,
        },
        "per_engine": per_engine,
    }
