"""Under pool pressure the simulator evicts what vLLM's KVCacheManager evicts, in its order.

Multi-turn conversations on a pool that holds about half of them (dense, sliding window, and
full attention + sliding window + Mamba), through SimCache and vLLM 0.33's real KVCacheManager
(`pool_pressure_runner.py`, in the vLLM environment): every step's admissions and hits, chunks,
preemptions and normalised events must be identical, so the same blocks are evicted in the same
order and the same returning turns find (or lose) their history.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
from vllm_recording import vllm_python

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SEEDS = 9  # three scenarios per profile


def test_sim_evicts_as_vllm_under_pool_pressure() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "sim")])}
    proc = subprocess.run(
        [str(vllm_python()), str(HERE / "pool_pressure_runner.py"), "--seeds", f"0-{SEEDS - 1}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == SEEDS, proc.stderr[-3000:]
    diverged = [x for x in lines if x["diverged"]]
    assert not diverged, json.dumps(diverged[0], indent=1)[:4000]
    assert proc.returncode == 0
    # the pool really was pressed: blocks evicted in every scenario, and in every profile some
    # returning turns kept their history and some lost it
    assert all(x["removed_blocks"] > 0 for x in lines)
    by_profile: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for x in lines:
        by_profile[x["profile"]][0] += x["kept"]
        by_profile[x["profile"]][1] += x["lost"]
    assert set(by_profile) == {"dense", "swa", "hybrid3"}
    assert all(kept > 0 and lost > 0 for kept, lost in by_profile.values()), dict(by_profile)
