"""`kvroute serve` start-up checks, and the benchmarks' smoke modes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvroute.cli import main as kvroute_main

ROOT = Path(__file__).resolve().parents[2]


def test_print_defaults_and_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kvroute_main(["serve", "--print-defaults"]) == 0
    assert "prefill_tokens_per_s" in capsys.readouterr().out
    cfg = tmp_path / "r.yaml"
    cfg.write_text(yaml.safe_dump({"workers": [{"name": "a", "url": "http://127.0.0.1:1"}]}))
    assert kvroute_main(["serve", "--config", str(cfg), "--check", "--policy", "session"]) == 0
    assert "policy session" in capsys.readouterr().out
    assert kvroute_main(["serve", "--config", str(cfg), "--check", "--policy", "nope"]) == 2
    assert "policy.name" in capsys.readouterr().err
    assert kvroute_main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2


def _bench(module: str, tmp_path: Path) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, "-m", module, "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=240,
        capture_output=True,
    )
    stem = module.rsplit(".", 1)[1]
    assert (tmp_path / f"{stem}_smoke.md").exists()
    data: dict[str, object] = json.loads((tmp_path / f"{stem}_smoke.json").read_text())
    return data


def test_http_client_bench_smoke(tmp_path: Path) -> None:
    data = _bench("bench.http_client_bench", tmp_path)
    assert data["smoke"] is True and data["chosen"] in ("aiohttp", "httpx")
    assert len(data["cells"]) == 8  # type: ignore[arg-type]
