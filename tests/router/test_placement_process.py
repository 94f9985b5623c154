"""Placement by working set on real processes: `kvroute sim fleet` with small KV pools and two
`kvroute serve` routers in front of it, the default one and one with the placement term on.

Every conversation starts with the same system prompt, so once one worker holds it the
default policy sends every new conversation there (it reuses the system prompt), and that
worker's pool, which holds about three conversations, evicts them turn after turn. With the
placement term the router reads each engine's pool from `vllm:cache_config_info`, counts the
conversations it expects back on each worker, and sends new conversations to the other
worker once the first one's working set no longer fits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvroute.testbed.procs import ProcessGroup, free_port, wait_http
from kvroute.testbed.sim_fleet import start_fleet

BLOCKS = 160  # x 16 tokens: 2,560 tokens per engine
ADMIN = "placement-test-admin-token"


@dataclass
class Routers:
    default: str
    placement: str
    model: str


def _start_router(pg: ProcessGroup, name: str, config: Path, env: dict[str, str]) -> str:
    port = free_port()
    cmd = [sys.executable, "-m", "kvroute", "serve", "--config", str(config)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    admin = {"KVROUTE_ADMIN__TOKEN": ADMIN, "KVROUTE_ADMIN__RESPONSE_HEADERS": "true"}
    child = pg.start(name, cmd, env={**base, **admin, **env})
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 60.0, child.popen)
    return url


@pytest.fixture(scope="module")
def routers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routers]:
    run_dir = tmp_path_factory.mktemp("placement")
    with ProcessGroup(run_dir) as pg:
        engine = ["--num-blocks", str(BLOCKS), "--max-model-len", "1024", "--speed", "20"]
        fleet = start_fleet(pg, workers=2, profile="dense", run_dir=run_dir, extra_args=engine)
        cfg = yaml.safe_load(Path(fleet.config_path).read_text())
        cfg["load"] = {"metrics_interval_s": 0.2, "metrics_max_interval_s": 0.2}
        config = run_dir / "router.yaml"
        config.write_text(yaml.safe_dump(cfg))
        default = _start_router(pg, "router-default", config, {})
        placement = _start_router(
            pg,
            "router-placement",
            config,
            {"KVROUTE_POLICY__PLACEMENT_WEIGHT": "1", "KVROUTE_POLICY__RETURN_INTERVAL_S": "5"},
        )
        yield Routers(default, placement, fleet.model)


def _call(url: str, body: Any = None) -> tuple[dict[str, Any], dict[str, str]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    req.add_header("content-type", "application/json")
    req.add_header("authorization", f"Bearer {ADMIN}")
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read()), dict(resp.headers)


def _workers(url: str) -> dict[str, dict[str, Any]]:
    listing, _ = _call(url + "/admin/workers")
    return {w["name"]: w for w in listing["workers"]}


# about 150 tokens of the simulated model, and 480 per user message
SYSTEM = "You are a careful assistant. " + " ".join(["Answer briefly and cite the rule."] * 7)


def _new_conversations(url: str, model: str, tag: str, count: int) -> list[tuple[str, int]]:
    """`count` new conversations one after another: (worker, prompt tokens) of each."""
    out = []
    for i in range(count):
        user = f"conversation {tag}{i}: " + "please summarise the quarterly report for me " * 25
        body = {
            "model": model,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
            "max_tokens": 4,
        }
        answer, headers = _call(url + "/v1/chat/completions", body)
        out.append((headers["x-kvroute-worker"], answer["usage"]["prompt_tokens"]))
        time.sleep(0.3)  # the events of the turn reach both routers
    return out


def wait_for_capacity(routers: Routers) -> dict[str, dict[str, Any]]:
    """Each worker's `capacity` on the placement router once both pools are known (or after
    20 s)."""
    deadline = time.monotonic() + 20
    while True:
        workers = _workers(routers.placement)
        caps = {n: w["capacity"] for n, w in workers.items()}
        if all(c["tokens"] is not None for c in caps.values()) or time.monotonic() > deadline:
            return caps
        time.sleep(0.2)


def test_capacity_is_read_from_the_engines(routers: Routers) -> None:
    caps = wait_for_capacity(routers)
    assert len(caps) == 2
    for cap in caps.values():
        assert cap["engine"] == {
            "num_gpu_blocks": BLOCKS,
            "block_size": 16,
            "kv_cache_size_tokens": BLOCKS * 16,
        }
        assert cap["tokens"] == BLOCKS * 16
    with urllib.request.urlopen(routers.placement + "/metrics", timeout=10) as resp:
        page = resp.read().decode()
    for name in caps:
        assert f'kvroute_worker_kv_capacity_tokens{{worker="{name}"}} {float(BLOCKS * 16)}' in page


def test_new_conversations_spread_by_working_set(routers: Routers) -> None:
    assert all(c["tokens"] == BLOCKS * 16 for c in wait_for_capacity(routers).values())
    placed = _new_conversations(routers.default, routers.model, "d", 8)
    sizes = [n for _, n in placed]
    assert all(500 < n < 1000 for n in sizes), sizes  # about 3.5 conversations per pool
    by_default = Counter(w for w, _ in placed)
    # the default follows the shared system prompt: one worker takes every conversation
    assert max(by_default.values()) == 8, by_default
    placed = _new_conversations(routers.placement, routers.model, "p", 8)
    by_placement = Counter(w for w, _ in placed)
    assert len(by_placement) == 2 and max(by_placement.values()) <= 5, by_placement
    workers = _workers(routers.placement)
    for name, w in workers.items():
        ws = w["working_set"]
        assert ws["conversations"] == by_placement[name]
        assert ws["tokens"] == sum(n for worker, n in placed if worker == name)
        # every worker's expected working set fits its pool, or nearly (one conversation)
        assert ws["tokens"] <= w["capacity"]["tokens"] + max(n for _, n in placed)
        assert w["capacity"]["peak_blocks_per_group"]  # the events' view of the pool


def test_inspect_shows_each_workers_pool_and_working_set(routers: Routers) -> None:
    wait_for_capacity(routers)
    _new_conversations(routers.placement, routers.model, "i", 2)
    workers = _workers(routers.placement)
    cmd = [sys.executable, "-m", "kvroute", "inspect", "--router", routers.placement]
    cmd += ["--model", routers.model, "--prompt", "hello"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    done = subprocess.run(
        cmd, env={**base, "KVROUTE_ADMIN__TOKEN": ADMIN}, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header = next(line.split() for line in lines if line.startswith("worker"))
    pool, ws = header.index("pool"), header.index("working_set")
    rows = {}
    for line in lines:
        cells = [c for c in line.split() if c != "*"]  # the chosen worker's mark
        if cells and cells[0] in workers:
            rows[cells[0]] = cells
    assert set(rows) == set(workers)
    for name, cells in rows.items():
        assert cells[pool] == str(BLOCKS * 16)
        assert cells[ws] == str(workers[name]["working_set"]["tokens"])
