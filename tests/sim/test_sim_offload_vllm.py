"""The sim's CPU tier agrees with vLLM 0.33's own `CPUOffloadingManager` (lru) on random
requests: the same hits, the same chunks stored and evicted each step, the same chunks held.
vLLM runs in its own environment (.venv-vllm) in a subprocess (`offload_vllm_runner.py`)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from vllm_env import vllm_python

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SEEDS = 60


@pytest.mark.vllm
def test_sim_cpu_tier_agrees_with_vllms_offloading_manager() -> None:
    python = vllm_python()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}"}
    proc = subprocess.run(
        [python, str(HERE / "offload_vllm_runner.py"), "--seeds", f"0-{SEEDS - 1}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == SEEDS, proc.stderr[-3000:]
    diverged = [x for x in lines if x["diverged"]]
    assert not diverged, json.dumps(diverged[0])
    # the runs exercised what they check: loads from the tier and evictions, every chunk size
    assert sum(x["loads"] for x in lines) > SEEDS and sum(x["evictions"] for x in lines) > SEEDS
    assert {x["chunk_blocks"] for x in lines} == {1, 2, 4}
