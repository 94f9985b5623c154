"""Fixtures of the tokenize tests: model directories built in memory, vLLM's reference."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenize_fixture_model import build_model_dir
from tokenize_helpers import KINDS, Oracle, vllm_python


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("models")
    return {kind: build_model_dir(base / kind, kind) for kind in KINDS}


@pytest.fixture(scope="session")
def oracle() -> Iterator[Oracle]:
    o = Oracle(vllm_python())
    yield o
    o.close()
