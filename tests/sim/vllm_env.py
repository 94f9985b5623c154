"""Where the sim tests find vLLM's environment (.venv-vllm), and what they do without it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def vllm_python() -> str:
    """The vLLM environment's python (KVROUTE_VLLM_PYTHON, else ROOT/.venv-vllm/bin/python).

    Skips the calling test when there is none, unless KVROUTE_REQUIRE_VLLM is set (as in
    `make test` and CI), in which case it fails.
    """
    for candidate in (os.environ.get("KVROUTE_VLLM_PYTHON"), str(ROOT / ".venv-vllm/bin/python")):
        if candidate and Path(candidate).exists():
            return candidate
    if os.environ.get("KVROUTE_REQUIRE_VLLM"):
        pytest.fail("KVROUTE_REQUIRE_VLLM is set but no .venv-vllm python was found")
    pytest.skip("vLLM environment (.venv-vllm) not available")


def run_in_vllm(argv: list[str], stdin: str | None = None) -> Any:
    """Run `python ARGV...` in vLLM's environment (this checkout on its path) and return the
    JSON value of the last line of its output that starts one; fails the test with the end of
    its stderr if it exits non-zero or prints none."""
    proc = subprocess.run(
        [vllm_python(), *argv],
        input=stdin,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line[:1] in ("{", "[")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"vLLM run failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(lines[-1])
