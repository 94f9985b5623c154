"""Real kvroute processes on loopback: simulated engines, bridges and routers that a test or a
benchmark starts, kills (SIGKILL), stops (SIGTERM), pauses (SIGSTOP) and restarts on the same
ports, so faults are the ones an operator sees: a process that dies, a socket that goes away.

    with Loopback() as lb:
        engines = lb.engines(2, "--speed", "200")      # started in parallel
        bridges = lb.bridges(engines)
        router = lb.router(lb.router_config(engines, bridges))
        ...
        lb.restart(engines[0], kill=True)             # same HTTP, PUB and replay ports

Every child gets PR_SET_PDEATHSIG (armed in the child by `kvroute.lifeline`), so nothing
outlives the test process; `close()` stops what is left. Each child's stderr goes to a log
file in the Loopback's directory (`Proc.log_tail()`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from kvroute import lifeline
from kvroute.sim.model import MODEL_DIR
from kvroute.testbed.procs import cpu_seconds

ROOT = Path(__file__).resolve().parent.parent
ADMIN_TOKEN = "reliability-admin-token"
MODEL = "kvroute-sim"
_BRIDGE_PORTS = re.compile(r"gRPC on port (\d+)(?:, HTTP on port (\d+))?")


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (for processes that cannot report their own)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


@dataclass
class Proc:
    """One child process."""

    name: str
    argv: list[str]
    popen: subprocess.Popen[str]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL and reap (a crash: no clean shutdown, sockets just vanish)."""
        if self.alive():
            self.popen.send_signal(signal.SIGCONT)
            self.popen.kill()
        self.popen.wait(10)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds."""
        if self.alive():
            self.popen.send_signal(signal.SIGCONT)
            self.popen.terminate()
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        self.popen.wait(10)

    def pause(self) -> None:
        self.popen.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.popen.send_signal(signal.SIGCONT)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Engine:
    """A `kvroute sim` process."""

    name: str
    proc: Proc
    url: str
    events: str
    replay: str | None
    args: tuple[str, ...]

    @property
    def ports(self) -> tuple[int, int, int | None]:
        return (
            int(self.url.rsplit(":", 1)[1]),
            _port_of(self.events),
            _port_of(self.replay) if self.replay else None,
        )


@dataclass
class Bridge:
    """A `kvroute bridge` process following one engine."""

    name: str
    proc: Proc
    engine: Engine
    grpc_port: int
    http_url: str
    args: tuple[str, ...]

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


@dataclass
class Router:
    """A `kvroute serve` process."""

    name: str
    proc: Proc
    url: str
    port: int
    config: dict[str, Any]
    config_path: Path


@dataclass
class Loopback:
    """Owns every process it starts; a context manager that stops them all on exit."""

    directory: Path | None = None
    startup_timeout: float = 60.0
    procs: list[Proc] = field(default_factory=list)
    _tmp: tempfile.TemporaryDirectory[str] | None = None
    _counter: int = 0

    def __post_init__(self) -> None:
        if self.directory is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvroute-loopback-")
            self.directory = Path(self._tmp.name)

    def __enter__(self) -> Loopback:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def dir(self) -> Path:
        assert self.directory is not None
        return self.directory

    # -- spawning -----------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> Proc:
        self._counter += 1
        log_path = self.dir / f"{self._counter:03d}-{name}.log"
        log_file = log_path.open("w")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        env.update(lifeline.env(signal.SIGKILL))  # armed by the child: no pre-exec hook
        popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=log_file,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=ROOT,
        )
        log_file.close()
        proc = Proc(name, argv, popen, log_path)
        self.procs.append(proc)
        return proc

    def _first_line(self, proc: Proc, deadline: float, pattern: re.Pattern[str] | None) -> str:
        """The first stdout line of `proc` (matching `pattern`), then stdout is drained."""
        stream = proc.popen.stdout
        assert stream is not None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                proc.kill()
                raise RuntimeError(f"{proc.name} not ready in time:\n{proc.log_tail()}")
            poller = select.poll()  # (select() fails on descriptors above 1024)
            poller.register(stream, select.POLLIN)
            if poller.poll(min(left, 0.2) * 1000):
                line = stream.readline()
                if line and (pattern is None or pattern.search(line)):
                    _drain(stream)
                    return line.strip()
            if not proc.alive():
                raise RuntimeError(
                    f"{proc.name} exited ({proc.popen.returncode}) at start:\n{proc.log_tail()}"
                )

    # -- engines --------------------------------------------------------------------------------
    def _engine_argv(self, args: tuple[str, ...], ports: tuple[int, int, int | None]) -> list[str]:
        http, events, replay = ports
        argv = [sys.executable, "-m", "kvroute", "sim", "--port", str(http)]
        argv += ["--events-endpoint", f"tcp://127.0.0.1:{events}"]
        if replay is not None:
            argv += ["--replay-endpoint", f"tcp://127.0.0.1:{replay}"]
        return argv + list(args)

    def engines(self, n: int, *args: str, prefix: str = "sim") -> list[Engine]:
        """`n` engines `prefix-0..n-1` with the same options, started in parallel."""
        names = [f"{prefix}-{i}" for i in range(n)]
        procs = [self._spawn(name, self._engine_argv(args, (0, 0, 0))) for name in names]
        deadline = time.monotonic() + self.startup_timeout
        return [
            self._engine_ready(name, p, args, deadline)
            for name, p in zip(names, procs, strict=True)
        ]

    def engine(self, name: str, *args: str) -> Engine:
        return self._engine_ready(
            name,
            self._spawn(name, self._engine_argv(args, (0, 0, 0))),
            args,
            time.monotonic() + self.startup_timeout,
        )

    def _engine_ready(
        self, name: str, proc: Proc, args: tuple[str, ...], deadline: float
    ) -> Engine:
        info = json.loads(self._first_line(proc, deadline, re.compile(r'"ready"')))
        return Engine(name, proc, info["url"], info["events"], info.get("replay"), args)

    def restart_engine(self, engine: Engine, *, kill: bool = True) -> Engine:
        """Crash (SIGKILL) or stop the engine, then start a fresh one on the same ports: its
        cache is empty and its event sequence starts again at 0."""
        if kill:
            engine.proc.kill()
        else:
            engine.proc.stop()
        proc = self._spawn(engine.name, self._engine_argv(engine.args, engine.ports))
        new = self._engine_ready(engine.name, proc, engine.args, time.monotonic() + 60)
        engine.proc, engine.url, engine.events, engine.replay = (
            new.proc,
            new.url,
            new.events,
            new.replay,
        )
        return engine

    # -- bridges --------------------------------------------------------------------------------
    def _bridge_argv(self, engine: Engine, args: tuple[str, ...], port: int) -> list[str]:
        argv = [sys.executable, "-m", "kvroute", "bridge", "--engine", engine.events]
        if engine.replay:
            argv += ["--replay", engine.replay]
        argv += ["--listen", f"127.0.0.1:{port}", "--http", "127.0.0.1:0"]
        argv += ["--log-level", "WARNING", *args]
        return argv

    def bridges(self, engines: list[Engine], *args: str) -> list[Bridge]:
        procs = [self._spawn(f"bridge-{e.name}", self._bridge_argv(e, args, 0)) for e in engines]
        deadline = time.monotonic() + self.startup_timeout
        return [
            self._bridge_ready(e, p, args, deadline) for e, p in zip(engines, procs, strict=True)
        ]

    def _bridge_ready(
        self, engine: Engine, proc: Proc, args: tuple[str, ...], deadline: float
    ) -> Bridge:
        line = self._first_line(proc, deadline, _BRIDGE_PORTS)
        found = _BRIDGE_PORTS.search(line)
        assert found is not None
        http = f"http://127.0.0.1:{found.group(2)}"
        return Bridge(f"bridge-{engine.name}", proc, engine, int(found.group(1)), http, args)

    def restart_bridge(self, bridge: Bridge, *, kill: bool = True) -> Bridge:
        """Crash (SIGKILL) or stop the bridge and start a new one on the same gRPC port."""
        if kill:
            bridge.proc.kill()
        else:
            bridge.proc.stop()
        deadline = time.monotonic() + 60
        while True:  # the old listener's port can take a moment to be free again
            proc = self._spawn(
                bridge.name, self._bridge_argv(bridge.engine, bridge.args, bridge.grpc_port)
            )
            try:
                new = self._bridge_ready(bridge.engine, proc, bridge.args, deadline)
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        bridge.proc, bridge.http_url = new.proc, new.http_url
        return bridge

    # -- routers --------------------------------------------------------------------------------
    def router_config(
        self,
        engines: list[Engine],
        bridges: list[Bridge] | None = None,
        **sections: Any,
    ) -> dict[str, Any]:
        """A router config for these engines (events through `bridges`, same order), tuned
        for tests: fast health checks and reconnects, admin token, response headers."""
        by_engine = {b.engine.name: b for b in bridges or []}
        workers = []
        for e in engines:
            w: dict[str, Any] = {"name": e.name, "url": e.url, "model": MODEL}
            if e.name in by_engine:
                w["bridge"] = by_engine[e.name].addr
            workers.append(w)
        config: dict[str, Any] = {
            "workers": workers,
            "models": {MODEL: {"tokenizer": str(MODEL_DIR)}},
            "admin": {"token": ADMIN_TOKEN, "response_headers": True},
            "health": {"interval_s": 0.25, "unhealthy_after": 1, "healthy_after": 1},
            "load": {"metrics_interval_s": 0.5},
            "timeouts": {"health_s": 0.5, "connect_s": 1.0},
            "events": {"reconnect_initial_s": 0.05, "reconnect_max_s": 0.5},
            "retry": {"backoff_initial_s": 0.005, "backoff_max_s": 0.05},
            "log_level": "warning",
        }
        for key, value in sections.items():
            if isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key] = {**config[key], **value}
            else:
                config[key] = value
        return config

    def router(self, config: dict[str, Any], name: str = "router", port: int = 0) -> Router:
        """Start `kvroute serve` with `config`; returns once /metrics answers (the app has
        started: first probes done, subscriptions opened)."""
        path = self.dir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        deadline = time.monotonic() + self.startup_timeout
        while True:
            chosen = port or free_port()
            argv = [sys.executable, "-m", "kvroute", "serve", "--config", str(path)]
            argv += ["--port", str(chosen)]
            proc = self._spawn(name, argv)
            url = f"http://127.0.0.1:{chosen}"
            try:
                _wait_http(url + "/metrics", proc, deadline)
                return Router(name, proc, url, chosen, config, path)
            except RuntimeError:
                if port or time.monotonic() > deadline:
                    raise
                # someone else took the free port in between: try another one

    def restart_router(self, router: Router, *, kill: bool = True) -> Router:
        if kill:
            router.proc.kill()
        else:
            router.proc.stop()
        new = self.router(router.config, router.name, router.port)
        router.proc = new.proc
        return router

    def close(self) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(Exception):
                if proc.alive():
                    proc.popen.send_signal(signal.SIGCONT)
                    proc.popen.terminate()
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(5)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _drain(stream: IO[str]) -> None:
    """Keep reading a child's stdout so it never blocks on a full pipe."""

    def run() -> None:
        with contextlib.suppress(ValueError, OSError):
            for _ in stream:
                pass

    threading.Thread(target=run, daemon=True).start()


def _wait_http(url: str, proc: Proc, deadline: float) -> None:
    import urllib.error
    import urllib.request

    while True:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{proc.name} did not answer {url} in time:\n{proc.log_tail()}")
        time.sleep(0.05)


def admin_headers() -> dict[str, str]:
    return {"authorization": f"Bearer {ADMIN_TOKEN}"}
