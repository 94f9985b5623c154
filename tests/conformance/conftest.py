"""Fixtures of the conformance tests: vLLM's recording (see vllm_recording.py)."""

from __future__ import annotations

from typing import Any

import pytest
from vllm_recording import load_recording


@pytest.fixture(scope="session")
def vllm_recording() -> dict[str, Any]:
    return load_recording()


@pytest.fixture(scope="session")
def scenarios_by_name(vllm_recording: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {sc["name"]: sc for sc in vllm_recording["scenarios"]}
