"""A real `kvroute serve` in front of a simulated fleet (`kvroute sim fleet`), attacked over
loopback with more slow uploads than max_in_flight, more unread streams than the upstream pool
and more connections than uvicorn's limit_concurrency: a fresh request must get an answer
quickly throughout and a 200 soon after (kvroute/testbed/edge_attacks.py holds the attacks)."""

from __future__ import annotations

import os
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from kvroute.testbed import edge_attacks as atk
from kvroute.testbed.procs import ProcessGroup, free_port, wait_http
from kvroute.testbed.sim_fleet import start_fleet

MIB = 1 << 20
# the edge bounds of the router under attack (small, so a short test reaches them)
LIMITS = {
    "KVROUTE_LIMITS__MAX_IN_FLIGHT": "16",
    "KVROUTE_LIMITS__MAX_BODY_BYTES": str(9 * MIB),
    "KVROUTE_LIMITS__UPSTREAM_CONNECTIONS": "4",
    "KVROUTE_EDGE__BODY_BYTES_IN_FLIGHT": str(16 * MIB),
    "KVROUTE_EDGE__BODY_READ_S": "1.0",
    "KVROUTE_EDGE__POOL_WAIT_S": "1.0",
    "KVROUTE_EDGE__WRITE_STALL_S": "1.0",
    "KVROUTE_EDGE__LIMIT_CONCURRENCY": "64",
    "KVROUTE_EDGE__CLIENT_SEND_BUFFER_BYTES": "16384",
}
POOL = int(LIMITS["KVROUTE_LIMITS__UPSTREAM_CONNECTIONS"])
CONNECTIONS = int(LIMITS["KVROUTE_EDGE__LIMIT_CONCURRENCY"])
# A non-reading client holds its stream until the kernel buffers between it and the router
# fill (~100 KB with the send buffer above), then write_stall_s: 1,500 tokens (~400 KB of
# events) always reach the stall, and keep the engines' wasted work short.
UNREAD_TOKENS = 1500
FRESH_DEADLINE_S = 5.0


@dataclass
class Served:
    url: str
    host: str
    port: int
    pid: int
    model: str
    log: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    run_dir = tmp_path_factory.mktemp("edge")
    with ProcessGroup(run_dir) as pg:
        fleet = start_fleet(
            pg,
            workers=2,
            profile="dense",
            run_dir=run_dir,
            extra_args=["--speed", "1000", "--max-model-len", "65536", "--num-blocks", "32768"],
        )
        cfg = yaml.safe_load(Path(fleet.config_path).read_text())
        cfg["health"] = {"interval_s": 0.5}
        config = run_dir / "router.yaml"
        config.write_text(yaml.safe_dump(cfg))
        port = free_port()
        cmd = [sys.executable, "-m", "kvroute", "serve", "--config", str(config)]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        env = {**LIMITS, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        child = pg.start("router", cmd, env=env)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", 60.0, child.popen)
        yield Served(url, "127.0.0.1", port, child.popen.pid, fleet.model, child.log)


def _metric(url: str, name: str, label: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " ")) and label in line
    )


def _wait_metric(url: str, name: str, label: str, at_least: float, wait_s: float = 5.0) -> float:
    """The metric once it reached `at_least`, or its value after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while (value := _metric(url, name, label)) < at_least and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def test_slow_uploads_beyond_max_in_flight(served: Served) -> None:
    chat = served.url + "/v1/chat/completions"
    body = atk.chat_body(served.model)
    with atk.slow_uploads(served.host, served.port, 24, "/v1/chat/completions") as socks:
        fresh = atk.post(chat, body, timeout_s=3.0)
        assert fresh.status in (200, 503) and fresh.seconds < 2.0  # an answer, at once
        statuses = [atk.answered(s, 3.0) for s in socks]
    assert statuses.count(408) >= 16 - 1, statuses  # the ones admitted: read deadline
    assert set(statuses) <= {408, 503}, statuses
    ok, _ = atk.first_ok_within(chat, body, 3.0)
    assert ok.status == 200


def test_unread_streams_beyond_the_upstream_pool(served: Served) -> None:
    chat = served.url + "/v1/chat/completions"
    body = atk.chat_body(served.model)
    stalls_before = _metric(served.url, "kvroute_errors_total", 'kind="write_stall"')
    disconnects = _metric(served.url, "kvroute_client_disconnects_total", "")
    with atk.unread_streams(served.host, served.port, 2 * POOL, served.model, UNREAD_TOKENS):
        # every upstream connection is held by a client that reads nothing; the stall
        # timeout frees them while those clients are still connected
        ok, answers = atk.first_ok_within(chat, body, FRESH_DEADLINE_S)
        assert ok.status == 200, answers
        # until then each fresh request was answered at once (503 after pool_wait_s)
        assert all(a.status in (200, 503) and a.seconds < 2.0 for a in answers), answers
        # and every stream admitted upstream (at least a pool's worth) ends by the stall
        # timeout, not by its client leaving
        stalls = _wait_metric(
            served.url, "kvroute_errors_total", 'kind="write_stall"', stalls_before + POOL
        )
        assert POOL <= stalls - stalls_before <= 2 * POOL
        assert _metric(served.url, "kvroute_client_disconnects_total", "") == disconnects
    ok, _ = atk.first_ok_within(chat, body, 3.0)
    assert ok.status == 200


def test_connections_beyond_limit_concurrency(served: Served) -> None:
    chat = served.url + "/v1/chat/completions"
    body = atk.chat_body(served.model)
    refused_before = _metric(served.url, "kvroute_errors_total", 'kind="concurrency_limit"')
    with atk.idle_connections(served.host, served.port, CONNECTIONS + 16):
        # uvicorn itself refuses, at once, without the app reading anything
        fresh = [atk.post(chat, body, timeout_s=3.0) for _ in range(5)]
        assert all(a.status == 503 and a.seconds < 1.0 for a in fresh), fresh
    # the flood gone, the router serves again (its connections are released as they close)
    ok, answers = atk.first_ok_within(chat, body, 3.0)
    assert ok.status == 200, answers
    refused = _metric(served.url, "kvroute_errors_total", 'kind="concurrency_limit"')
    # each refusal counted (the /metrics scrapes themselves were not refused)
    assert refused - refused_before == 5 + sum(a.status == 503 for a in answers)
    # and logged once for all of them (uvicorn's own line, held back by the router)
    assert served.log.read_text().count("Exceeded concurrency limit") == 1
