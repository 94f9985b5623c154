"""SimCache and vLLM's real KVCacheManager make the same decisions on random request sequences.

Both are driven by the simulator's scheduler (continuous batching, chunked prefill, preemption,
resets) over random prompts that share prefixes, in every profile (dense, sliding window,
Mamba 16/64, hybrids) and retention mode; the traces (admissions and hits, chunk sizes,
preemptions, pool usage, normalised event streams, per-group hits of final probes) must be
identical. vLLM runs in its own environment (.venv-vllm) in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_env import vllm_python

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


@pytest.mark.vllm
def test_sim_cache_agrees_with_vllm_kv_cache_manager() -> None:
    python = vllm_python()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}"}
    proc = subprocess.run(
        [python, str(HERE / "vllm_agreement_runner.py"), "--seeds", "0-59"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 60, proc.stderr[-3000:]
    diverged = [x for x in lines if x["diverged"]]
    assert not diverged, json.dumps(diverged[0], indent=1)[:4000]
    assert proc.returncode == 0
    print(f"{len(lines)} scenarios agree", file=sys.stderr)
