"""Multi-turn conversations on a pool that holds about half of them, through SimCache and vLLM's
real KVCacheManager: the same admissions, hits, chunking, preemptions and events (so the same
blocks evicted in the same order), per profile.

Run in the vLLM environment with the repository and tests/sim on PYTHONPATH:
    python tests/conformance/pool_pressure_runner.py --seeds 0-5
Prints one JSON line per scenario and exits 1 if any diverged. The scheduler and the comparison
are tests/sim/vllm_agreement_runner.py's; this file only builds the request sequences: each
conversation's turn resends its previous prompt, a synthetic answer and a new user message,
turns arrive after their predecessor had time to finish, and conversations overlap.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from typing import Any

from vllm_agreement_runner import PROFILES, first_divergence, run

from kvroute.sim.cache import SimCache

BLOCK = 16
PRESSURE_PROFILES = ("dense", "swa", "hybrid3")


def make_scenario(seed: int) -> dict[str, Any]:
    """Conversations of 4-7 turns over a few shared system prompts; the pool holds about half
    of the conversations' mean live size (never less than two of the largest requests)."""
    rng = random.Random(f"pool-pressure/{seed}")
    profile = PRESSURE_PROFILES[seed % len(PRESSURE_PROFILES)]
    systems = [[rng.randrange(5, 4000) for _ in range(rng.randint(32, 96))] for _ in range(3)]
    requests: list[dict[str, Any]] = []
    sizes: list[float] = []
    longest = 0
    for c in range(rng.randint(8, 12)):
        tokens = list(rng.choice(systems))
        arrive = rng.randint(0, 40)
        lengths = []
        for turn in range(rng.randint(4, 7)):
            tokens += [rng.randrange(5, 4000) for _ in range(rng.randint(20, 80))]
            max_tokens = rng.randint(1, 8)
            requests.append(
                {
                    "id": f"c{c}t{turn}",
                    "tokens": list(tokens),
                    "max_tokens": max_tokens,
                    "arrive": arrive,
                    "salt": None,
                    "lora": None,
                }
            )
            lengths.append(len(tokens))
            longest = max(longest, len(tokens) + max_tokens)
            tokens += [rng.randrange(5, 4000) for _ in range(rng.randint(10, 40))]  # its answer
            arrive += rng.randint(25, 60)  # the previous answer, then the user's think time
        sizes.append(sum(lengths) / len(lengths))
    groups = len(PROFILES[profile])
    live_blocks = sum(sizes) / BLOCK  # every conversation live at its mean size
    floor = 2 * groups * math.ceil(longest / BLOCK) + 4
    return {
        "seed": seed,
        "profile": profile,
        "retention": 0,
        "num_blocks": max(floor, round(0.5 * live_blocks)),
        "budget": 128,
        "max_num_seqs": 4,
        "requests": requests,
        "reset_at": None,
    }


def pressure(trace: list[Any], scenario: dict[str, Any]) -> dict[str, int]:
    """How hard the pool was pressed: blocks removed, and returning turns (turn > 0) that found
    at least their previous prompt's full blocks at admission ("kept") or not ("lost")."""
    prompt_len = {r["id"]: len(r["tokens"]) for r in scenario["requests"]}
    first_hit: dict[str, int] = {}
    removed = 0
    for entry in trace:
        if entry[0] != "step":
            continue
        for rid, _num, new, cached in entry[2]:
            if new:
                first_hit.setdefault(rid, cached)
        removed += sum(len(e["block_hashes"]) for e in entry[4] if e["type"] == "BlockRemoved")
    kept = lost = 0
    for rid, cached in first_hit.items():
        conv, turn = rid[1:].split("t")
        if int(turn) == 0:
            continue
        prev = prompt_len[f"c{conv}t{int(turn) - 1}"]
        if cached >= prev // BLOCK * BLOCK - BLOCK:
            kept += 1
        else:
            lost += 1
    return {"removed_blocks": removed, "kept": kept, "lost": lost}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="0-5")
    args = parser.parse_args(argv)
    lo, _, hi = args.seeds.partition("-")
    from kvroute.sim.vllm_backend import VllmCacheBackend  # only importable in .venv-vllm

    bad = 0
    for seed in range(int(lo), int(hi or lo) + 1):
        sc = make_scenario(seed)
        sim = run(SimCache, sc)
        diff = first_divergence(sim, run(VllmCacheBackend, sc))
        bad += diff is not None
        line = {"seed": seed, "profile": sc["profile"], "num_blocks": sc["num_blocks"]}
        line |= {"diverged": diff is not None, "diff": diff, **pressure(sim, sc)}
        print(json.dumps(line, default=str))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
