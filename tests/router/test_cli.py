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
    with pytest.raises(SystemExit) as exit_info:  # argparse: --policy has fixed choices
        kvroute_main(["serve", "--config", str(cfg), "--check", "--policy", "nope"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    with_bad_policy = tmp_path / "bad.yaml"
    with_bad_policy.write_text(
        yaml.safe_dump({**yaml.safe_load(cfg.read_text()), "policy": {"name": "nope"}})
    )
    assert kvroute_main(["serve", "--config", str(with_bad_policy), "--check"]) == 2
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
    assert data["smoke"] is True and data["chosen"] in ("aiohttp", "httpx", "kvroute-http1")
    assert len(data["cells"]) == 12  # type: ignore[arg-type]


def test_serve_with_two_processes(tmp_path: Path) -> None:
    """`kvroute serve --workers 2`: two router processes answer on one port."""
    import signal
    import time
    import urllib.request

    from bench.instant_engine import running_engine
    from kvroute.testbed.procs import free_port

    with running_engine() as engine:
        port = free_port()
        cfg = tmp_path / "r.yaml"
        cfg.write_text(
            yaml.safe_dump(
                {
                    "workers": [{"name": "w0", "url": engine, "model": "m"}],
                    "port": port,
                    "log_level": "warning",
                }
            )
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvroute", "serve", "--config", str(cfg), "--workers", "2"],
            env=env,
            start_new_session=True,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                        if resp.status == 200:
                            break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "router did not come up"
                time.sleep(0.2)
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            for _ in range(20):
                req = urllib.request.Request(
                    url + "/v1/chat/completions",
                    data=body.encode(),
                    headers={"content-type": "application/json"},
                )
                with urllib.request.urlopen(req, timeout=5) as resp:
                    assert resp.status == 200
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            # uvicorn's supervisor spawns the router processes via multiprocessing
            servers = [
                c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()
            ]
            assert len(servers) == 2
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_router_overhead_bench_smoke(tmp_path: Path) -> None:
    data = _bench("bench.router_overhead_bench", tmp_path)
    assert data["benchmark"] == "router_overhead" and data["smoke"] is True
    cells = data["proxy"]
    assert isinstance(cells, list) and len(cells) == 4
    decision = data["decision"]
    assert isinstance(decision, dict) and decision["chosen"] == decision["expected"]
    paced = data["paced"]
    assert isinstance(paced, dict)
    for mode in ("staggered", "synchronized"):
        cell = paced[mode]
        assert cell["router"]["first_median_ms"] > 0 and cell["direct"]["total_median_ms"] > 0
        assert "added_total_median_ms" in cell and cell["router_cpu_us_per_req"] > 0
    md = (tmp_path / "router_overhead_bench_smoke.md").read_text()
    assert "**Target: <= 1 ms added at the median with 64 concurrent streams: " in md
