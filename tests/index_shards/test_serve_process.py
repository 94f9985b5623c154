"""A real `kvroute serve --workers 2` with `index.processes: 2` in front of `kvroute sim fleet`
(engines and bridges as processes): the two router processes share the host's two shard
processes (not a copy each), route follow-up turns to their cache, and keep answering while
a shard is killed and restarted."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from kvroute.testbed.procs import ProcessGroup, free_port, wait_http
from kvroute.testbed.sim_fleet import start_fleet

SHARD_MODULE = "kvroute.router.index_shards.server"
ADMIN = "shard-process-admin-token"


def shard_pids(root: int) -> list[int]:
    """Shard processes descended from `root` (read from /proc)."""
    parents: dict[int, int] = {}
    commands: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        commands[int(entry)] = cmd

    def under(pid: int) -> bool:
        while pid > 1:
            if pid == root:
                return True
            pid = parents.get(pid, 0)
        return False

    return sorted(p for p, c in commands.items() if SHARD_MODULE in c and under(p))


def get(url: str) -> tuple[int, Any]:
    req = urllib.request.Request(url, headers={"authorization": f"Bearer {ADMIN}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def chat(url: str, model: str, messages: list[dict[str, str]]) -> tuple[str, int]:
    body = json.dumps({"model": model, "messages": messages, "max_tokens": 4}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST")
    req.add_header("content-type", "application/json")
    with urllib.request.urlopen(req, timeout=30) as resp:
        answer = json.loads(resp.read())
        worker = resp.headers["x-kvroute-worker"]
    return worker, answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def until(cond: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


def test_router_processes_share_the_hosts_shards(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path) as pg:
        fleet = start_fleet(pg, workers=3, profile="dense", run_dir=tmp_path)
        cfg = yaml.safe_load(Path(fleet.config_path).read_text())
        assert all(w.get("bridge") for w in cfg["workers"])
        cfg["index"] = {"processes": 2, "deadline_s": 2.0, "status_interval_s": 0.1}
        cfg["admin"] = {"token": ADMIN, "response_headers": True}
        config = tmp_path / "router.yaml"
        config.write_text(yaml.safe_dump(cfg))
        port = free_port()
        cmd = [sys.executable, "-m", "kvroute", "serve", "--config", str(config), "--workers"]
        cmd += ["2", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        router = pg.start("router", cmd, env=env)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", 60.0, router.popen)
        until(lambda: get(url + "/readyz")[0] == 200, 60.0)
        shards = shard_pids(router.popen.pid)
        assert len(shards) == 2  # one set for the host, not one per router process

        def conversation(s: int, turns: int) -> list[tuple[str, int]]:
            messages = [{"role": "system", "content": f"Conversation {s}. " * 60}]
            out = []
            for t in range(turns):
                messages.append({"role": "user", "content": f"Question {t} of {s}. " * 10})
                out.append(chat(url, fleet.model, messages))
                messages.append({"role": "assistant", "content": "Noted."})
                time.sleep(0.3)  # the engine's events reach the shards
            return out

        for s in range(3):
            turns = conversation(s, 3)
            homes = {worker for worker, _ in turns}
            assert len(homes) == 1, turns  # every follow-up went where its history is
            assert all(cached > 100 for _, cached in turns[1:]), turns

        os.kill(shards[0], signal.SIGKILL)
        # answered at once, from the other shard's evidence and none for the killed one's
        for i in range(6):
            worker, _ = chat(url, fleet.model, [{"role": "user", "content": f"Now {i}"}])
            assert worker in {w["name"] for w in cfg["workers"]}
        until(lambda: len(shard_pids(router.popen.pid)) == 2, 30.0)
        assert shards[0] not in shard_pids(router.popen.pid)
        # each router process has its own connections to the shards: ask until several
        # answers in a row (from either process) say the index is back
        until(lambda: all(caught_up(url) for _ in range(8)), 60.0)
        turns = conversation(10, 2)
        assert turns[1][0] == turns[0][0] and turns[1][1] > 100, turns


def caught_up(url: str) -> bool:
    ready = get(url + "/readyz")[0] == 200
    return ready and all((w["events"] or {}).get("state") == "live" for w in workers(url))


def workers(url: str) -> list[dict[str, Any]]:
    status, body = get(url + "/admin/workers")
    assert status == 200, body
    return list(body["workers"])
