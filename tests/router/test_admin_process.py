"""The admin API of a real `kvroute serve` process in front of a simulated fleet
(`kvroute sim fleet`), with its tokens given the way the Helm chart gives them (an environment
variable from a Secret) and as a mounted file; `kvroute inspect` run as a process too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvroute.router.config_load import env_name
from kvroute.testbed.procs import ProcessGroup, free_port, wait_http
from kvroute.testbed.sim_fleet import start_fleet

FULL = "process-full-admin-token"
READ = "process-read-only-token"


@dataclass
class Served:
    url: str
    read_file: Path
    worker_url: str
    model: str


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_ADMIN")}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    run_dir = tmp_path_factory.mktemp("admin")
    read_file = run_dir / "read-token"
    read_file.write_text(READ + "\n")
    with ProcessGroup(run_dir) as pg:
        fleet = start_fleet(pg, workers=1, profile="dense", run_dir=run_dir)
        cfg = yaml.safe_load(Path(fleet.config_path).read_text())
        cfg["health"] = {"interval_s": 0.5}
        config = run_dir / "router.yaml"
        config.write_text(yaml.safe_dump(cfg))
        port = free_port()
        cmd = [sys.executable, "-m", "kvroute", "serve", "--config", str(config)]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        env = {
            "KVROUTE_ADMIN__TOKEN": FULL,  # as the chart's secretKeyRef sets it
            "KVROUTE_ADMIN__READ_TOKEN_FILE": str(read_file),
            "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        }
        child = pg.start("router", cmd, env={**_clean_env(), **env})
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", 60.0, child.popen)
        yield Served(url, read_file, cfg["workers"][0]["url"], fleet.model)


def call(url: str, method: str, token: str | None, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("content-type", "application/json")
    if token:
        req.add_header("authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def inspect(served: Served, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvroute", "inspect", "--router", served.url, "--prompt", "hi"]
    return subprocess.run(
        cmd, env={**_clean_env(), **env}, capture_output=True, text=True, timeout=60
    )


def test_inspect_reads_the_variables_the_server_reads(served: Served) -> None:
    # the names the server was started with are the config keys' own variable names
    assert env_name("admin.token") == "KVROUTE_ADMIN__TOKEN"
    assert env_name("admin.read_token_file") == "KVROUTE_ADMIN__READ_TOKEN_FILE"
    for env in (
        {"KVROUTE_ADMIN__TOKEN": FULL},
        {"KVROUTE_ADMIN__READ_TOKEN": READ},
        {"KVROUTE_ADMIN__READ_TOKEN_FILE": str(served.read_file)},
    ):
        done = inspect(served, env)
        assert done.returncode == 0, (env, done.stderr)
        assert "chosen: " in done.stdout and "est_ttft_s" in done.stdout
    old = inspect(served, {"KVROUTE_ADMIN_TOKEN": FULL})  # the name inspect once read
    assert old.returncode == 1 and "HTTP 401" in old.stderr
    wrong = inspect(served, {"KVROUTE_ADMIN__TOKEN": "not-the-token"})
    assert wrong.returncode == 1 and "HTTP 401" in wrong.stderr


def test_read_only_and_full_tokens_on_a_real_router(served: Served) -> None:
    workers = served.url + "/admin/workers"
    status, listing = call(workers, "GET", READ)
    assert status == 200
    name = listing["workers"][0]["name"]
    drain = f"{workers}/{name}/drain"
    assert call(workers, "GET", None)[0] == 401
    assert call(drain, "POST", None)[0] == 401
    status, body = call(drain, "POST", READ)
    assert status == 403 and "read-only" in body["error"]["message"]
    assert call(f"{workers}/{name}", "GET", READ)[1]["state"] == "active"
    status, body = call(drain, "POST", FULL)
    assert status == 200 and body["state"] == "draining"
    status, body = call(f"{workers}/{name}/undrain", "POST", FULL)
    assert status == 200 and body["state"] == "active"


def _metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text: str = resp.read().decode()
    return text


def test_a_removed_workers_series_leave_metrics(served: Served) -> None:
    workers = served.url + "/admin/workers"
    (first,) = [w["name"] for w in call(workers, "GET", READ)[1]["workers"]]
    spec = {"name": "team-a/vllm-7", "url": served.worker_url, "model": served.model}
    assert call(workers, "POST", FULL, spec)[0] == 201
    assert call(f"{workers}/{first}/drain", "POST", FULL)[0] == 200
    try:
        for i in range(3):
            chat = {"model": served.model, "messages": [{"role": "user", "content": f"q{i}"}]}
            status, _ = call(served.url + "/v1/chat/completions", "POST", None, chat)
            assert status == 200
    finally:
        assert call(f"{workers}/{first}/undrain", "POST", FULL)[0] == 200
    label = 'worker="team-a/vllm-7"'
    text = _metrics(served.url)
    assert f'kvroute_upstream_responses_total{{outcome="2xx",{label}}} 3.0' in text
    status, body = call(f"{workers}/team-a/vllm-7", "DELETE", FULL)
    assert status == 200 and body["removed"] is True  # idle: removed at once
    text = _metrics(served.url)
    assert label not in text
    assert f'worker="{first}"' in text
