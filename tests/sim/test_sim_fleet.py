"""`kvroute sim fleet`: real processes on loopback, stopped without leaking processes or ports."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _port_open(addr: str) -> bool:
    host, _, port = addr.rpartition(":")
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, int(port))) == 0


def _start(args: list[str], tmp_path: Path) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    cmd = [
        sys.executable,
        "-m",
        "kvroute",
        "sim",
        "fleet",
        *args,
        "--config-out",
        str(tmp_path / "router.yaml"),
        "--info-out",
        str(tmp_path / "info.json"),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("{"):
                info: dict[str, Any] = json.loads(line)
                if info.get("fleet_ready"):
                    return proc, info
        assert proc.poll() is None, f"fleet exited with {proc.returncode}"
    proc.kill()
    raise AssertionError("fleet did not become ready")


def _children(info: dict[str, Any]) -> list[int]:
    pids = [w["engine_pid"] for w in info["workers"]]
    return pids + [w["bridge_pid"] for w in info["workers"] if w["bridge_pid"]]


@pytest.mark.parametrize(
    ("sig", "n"), [(signal.SIGTERM, 2), (signal.SIGINT, 1), (signal.SIGKILL, 1)]
)
def test_fleet_starts_serves_and_stops_cleanly(tmp_path: Path, sig: signal.Signals, n: int) -> None:
    proc, info = _start(
        [
            "--workers",
            str(n),
            "--model-profile",
            "mamba",
            "--speed",
            "50",
            "--num-blocks",
            "512",
            "--max-model-len",
            "1024",
        ],
        tmp_path,
    )
    try:
        workers = info["workers"]
        assert len(workers) == n
        assert len({w["url"] for w in workers}) == n
        config = yaml.safe_load((tmp_path / "router.yaml").read_text())
        assert [w["url"] for w in config["workers"]] == [w["url"] for w in workers]
        assert config["models"]["kvroute-sim"]["tokenizer"].endswith("kvroute/sim/model")
        assert config["models"]["kvroute-sim"]["alignment"] == 16
        # the router's tokenizer is the engines' own: plain chats go to them as token ids
        assert config["models"]["kvroute-sim"]["send_token_ids"] is True
        assert json.loads((tmp_path / "info.json").read_text())["workers"] == workers
        for w in workers:
            assert httpx.get(f"{w['url']}/health", timeout=5).status_code == 200
            r = httpx.post(
                f"{w['url']}/v1/completions",
                json={"prompt": "hello fleet", "max_tokens": 2},
                timeout=10,
            )
            assert r.status_code == 200
            # each engine names itself, so a benchmark can attribute requests behind any router
            assert r.json()["system_fingerprint"] == w["name"]
            assert w["bridge"] and _port_open(w["bridge"])
            assert config["workers"][workers.index(w)]["bridge"] == w["bridge"]
        pids = _children(info)
        assert all(_alive(p) for p in pids)
    finally:
        os.kill(proc.pid, sig)
        proc.wait(30)
    if sig != signal.SIGKILL:
        assert proc.returncode == 0
    deadline = time.monotonic() + 15  # SIGKILL: the children notice via PR_SET_PDEATHSIG
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)
    for w in workers:
        assert not _port_open(w["url"].removeprefix("http://"))
        assert not _port_open(w["bridge"])


def test_fleet_without_bridges_writes_zmq_workers(tmp_path: Path) -> None:
    proc, info = _start(
        ["--workers", "1", "--no-bridge", "--speed", "50", "--topic", "kv"], tmp_path
    )
    try:
        (worker,) = yaml.safe_load((tmp_path / "router.yaml").read_text())["workers"]
        assert worker["zmq"] == info["workers"][0]["events"]
        assert worker["replay"] == info["workers"][0]["replay"] and worker["topic"] == "kv"
        assert "bridge" not in worker
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0
    assert not any(_alive(p) for p in _children(info))


def test_pooling_fleet_serves_embeddings_and_routes_them_by_cache(tmp_path: Path) -> None:
    proc, info = _start(["--workers", "1", "--no-bridge", "--runner", "pooling"], tmp_path)
    try:
        config = yaml.safe_load((tmp_path / "router.yaml").read_text())
        assert config["models"]["kvroute-sim"]["embeddings_use_cache"] is True
        url = info["workers"][0]["url"]
        r = httpx.post(f"{url}/v1/embeddings", json={"input": "hello fleet"}, timeout=10)
        assert r.status_code == 200 and r.json()["data"][0]["object"] == "embedding"
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 404
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0


def test_fleet_rejects_bad_arguments() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvroute", "sim", "fleet", "--workers", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2
    r = subprocess.run(
        [sys.executable, "-m", "kvroute", "sim", "fleet", "--num-blocks", "3"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "num_blocks" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "kvroute", "sim", "fleet", "--prefill", "1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "--prefill and --decode" in r.stderr


def test_fleet_stops_everything_when_a_child_dies(tmp_path: Path) -> None:
    proc, info = _start(["--workers", "2", "--no-bridge", "--speed", "50"], tmp_path)
    os.kill(info["workers"][0]["engine_pid"], signal.SIGKILL)
    proc.wait(30)
    assert proc.returncode == 1
    assert not any(_alive(p) for p in _children(info))
