"""Where the sim tests find vLLM's environment (.venv-vllm), and what they do without it."""

from __future__ import annotations

import os
from pathlib import Path

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
