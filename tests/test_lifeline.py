"""`kvroute.lifeline`: children armed in the child die with their parent, and launching them
while this process's gRPC threads are busy no longer crashes them at start."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc import aio

from bench.loopback import Loopback
from kvroute import lifeline

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(120)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead for our purposes
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.fixture
def busy_grpc() -> Iterator[None]:
    """A gRPC server and a client calling it without pause, on a thread of this process."""
    stop = threading.Event()
    calls = [0]

    async def run() -> None:
        server = aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/kvroute.Test/Nothing")
            while not stop.is_set():
                try:
                    await call(b"", timeout=1)
                except grpc.RpcError:
                    calls[0] += 1  # UNIMPLEMENTED: still a full round trip through gRPC
        await server.stop(None)

    thread = threading.Thread(target=lambda: asyncio.run(run()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while calls[0] < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls[0] >= 10, "the gRPC load did not start"
    yield
    stop.set()
    thread.join(10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_children_start_cleanly_while_this_process_is_busy_in_grpc(busy_grpc: None) -> None:
    # With a pre-exec hook, about one child in eight crashed here (gRPC's fork handlers).
    with Loopback() as lb:
        procs = [
            lb._spawn(f"child-{i}", [sys.executable, "-c", "import time; time.sleep(0.05)"])
            for i in range(40)
        ]
        codes = [p.popen.wait(30) for p in procs]
    assert codes == [0] * 40, [
        (p.name, p.log_tail()) for p, c in zip(procs, codes, strict=True) if c
    ]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_an_armed_child_dies_with_its_parent() -> None:
    # parent: starts an armed child, prints its pid, waits; we SIGKILL the parent
    parent_code = (
        "import subprocess, sys, os, signal, time\n"
        "from kvroute import lifeline\n"
        "code = 'from kvroute import lifeline; lifeline.arm(); import time; time.sleep(60)'\n"
        "env = {**os.environ, **lifeline.env(signal.SIGTERM)}\n"
        "child = subprocess.Popen([sys.executable, '-c', code], env=env)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    time.sleep(0.5)  # the child armed itself (python start-up)
    assert _alive(child)
    parent.kill()
    parent.wait(10)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_kvroute_exits_when_the_parent_it_was_armed_against_is_gone() -> None:
    # the named parent is not ours: as if it died before the child armed itself
    env = {**os.environ, "PYTHONPATH": str(ROOT), lifeline.ENV: "1:15"}
    done = subprocess.run(
        [sys.executable, "-m", "kvroute", "--help"], env=env, capture_output=True, text=True
    )
    if sys.platform.startswith("linux"):
        assert done.returncode != 0
        assert "has exited" in done.stderr
    else:
        assert done.returncode == 0


def test_arm_takes_the_entry_out_so_grandchildren_are_not_armed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # signal 0 clears the parent-death signal: harmless for the test process itself
    monkeypatch.setenv(lifeline.ENV, f"{os.getppid()}:0")
    lifeline.arm()
    assert lifeline.ENV not in os.environ


@pytest.mark.parametrize("value", ["", "x", "1", "1:2:3", "a:b"])
def test_a_malformed_entry_is_ignored(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(lifeline.ENV, value)
    lifeline.arm()  # neither raises nor exits
    assert lifeline.ENV not in os.environ


def test_env_names_this_process_and_the_signal() -> None:
    assert lifeline.env(signal.SIGKILL) == {lifeline.ENV: f"{os.getpid()}:{int(signal.SIGKILL)}"}
