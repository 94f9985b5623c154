"""Starts the host's K index shard processes and restarts any that exits, with backoff.

One supervisor per router host: `kvroute serve` runs it in the parent process, so the N
router processes of `--workers N` share the same K shards. The sockets live in a private
directory (mode 0700) that only this user can enter; each shard also refuses peers of
another user. A restarted shard gets the next generation number, which it reports in its
status answers (the routers count restarts from it).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from kvroute.router.index_shards.server import SETTINGS_ENV, ShardSettings

log = logging.getLogger("kvroute.index_shards")
DIR_ENV = "KVROUTE_INDEX_SHARD_DIR"  # set for router processes: the shards' directory
RESOLVED_ENV = "KVROUTE_RESOLVED_CONFIG"  # kvroute.router.cli's, for its router processes
STABLE_AFTER_S = 30.0  # a shard that ran this long restarts at the initial backoff again


def socket_path(directory: str, shard: int) -> str:
    return os.path.join(directory, f"shard-{shard}.sock")


@dataclass(slots=True)
class _Child:
    shard: int
    process: subprocess.Popen[bytes] | None = None
    generation: int = -1
    started_at: float = 0.0
    delay_s: float = 0.0
    next_start: float = 0.0
    exits: list[int | None] = field(default_factory=list)


class ShardSupervisor:
    """K shard processes under `directory` (a fresh private one when None)."""

    def __init__(
        self,
        shards: int,
        settings: ShardSettings,
        *,
        restart_initial_s: float = 0.2,
        restart_max_s: float = 10.0,
    ) -> None:
        self.shards = shards
        self._settings = settings
        self._initial = restart_initial_s
        self._max = restart_max_s
        self.directory = tempfile.mkdtemp(prefix="kvroute-index-")  # mode 0700
        self._children = [_Child(i) for i in range(shards)]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.restarts = 0

    def socket(self, shard: int) -> str:
        return socket_path(self.directory, shard)

    def start(self) -> None:
        """Start every shard and the thread that keeps them running."""
        with self._lock:
            for child in self._children:
                self._spawn(child)
        self._thread = threading.Thread(
            target=self._watch, name="kvroute-index-shards", daemon=True
        )
        self._thread.start()

    def pid(self, shard: int) -> int | None:
        proc = self._children[shard].process
        return proc.pid if proc is not None else None

    def _spawn(self, child: _Child) -> None:
        child.generation += 1
        env = dict(os.environ)
        env.pop(RESOLVED_ENV, None)  # the router's whole config (admin tokens): not needed
        env[SETTINGS_ENV] = self._settings.to_json()
        child.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvroute.router.index_shards.server",
                "--socket",
                self.socket(child.shard),
                "--shard",
                str(child.shard),
                "--generation",
                str(child.generation),
                "--parent",
                str(os.getpid()),
            ],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        child.started_at = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            now = time.monotonic()
            with self._lock:
                for child in self._children:
                    self._check(child, now)

    def _check(self, child: _Child, now: float) -> None:
        proc = child.process
        if proc is not None:
            code = proc.poll()
            if code is None:
                return
            child.process = None
            child.exits.append(code)
            del child.exits[:-16]
            ran = now - child.started_at
            child.delay_s = (
                self._initial
                if ran >= STABLE_AFTER_S or child.delay_s == 0
                else min(child.delay_s * 2, self._max)
            )
            child.next_start = now + child.delay_s
            self.restarts += 1
            log.warning(
                "index shard %d exited (%s) after %.1f s; restarting in %.1f s",
                child.shard,
                code,
                ran,
                child.delay_s,
            )
            return
        if now >= child.next_start and not self._stop.is_set():
            self._spawn(child)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the shards (SIGTERM, then SIGKILL after `timeout_s`) and remove the directory."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            procs = [c.process for c in self._children if c.process is not None]
            for proc in procs:
                proc.terminate()
            deadline = time.monotonic() + timeout_s
            for proc in procs:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)
