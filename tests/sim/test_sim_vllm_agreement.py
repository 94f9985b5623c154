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

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def _vllm_python() -> str | None:
    candidates = [os.environ.get("KVROUTE_VLLM_PYTHON"), str(ROOT / ".venv-vllm/bin/python")]
    for c in candidates:
        if c and Path(c).exists():
            return c
    return None


@pytest.mark.vllm
def test_sim_cache_agrees_with_vllm_kv_cache_manager() -> None:
    python = _vllm_python()
    if python is None:
        if os.environ.get("KVROUTE_REQUIRE_VLLM"):
            pytest.fail("KVROUTE_REQUIRE_VLLM is set but no .venv-vllm python was found")
        pytest.skip("vLLM environment (.venv-vllm) not available")
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
