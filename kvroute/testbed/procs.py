"""Child processes for benchmarks: own process group, bounded waits, always cleaned up.

Every process a benchmark starts goes through :class:`ProcessGroup`: each child runs in its
own session (so its own children die with it), its output goes to a log file, and
``stop_all`` (also on exit of the ``with`` block) sends SIGTERM to each group, waits a
bounded time, then SIGKILLs whatever is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (ephemeral range)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Wait until GET ``url`` answers with any HTTP status < 500; raise TimeoutError."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status < 500:
                    return
        except urllib.error.HTTPError as exc:
            if exc.code < 500:
                return
            last = f"http {exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout_s}s ({last})")


def _stat_fields(pid: int | str) -> list[str]:
    # after the command name (which may hold spaces and parentheses): state, ppid, pgrp, ...
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _fields_cpu_seconds(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a live process has used so far."""
    return _fields_cpu_seconds(_stat_fields(pid))


def group_cpu_seconds(pgid: int) -> float:
    """CPU time used so far by the live processes of one process group (a router and any
    workers it forked)."""
    return sum(cpu for _, cpu in group_cpu_by_command(pgid).values())


def group_cpu_by_command(pgid: int) -> dict[int, tuple[str, float]]:
    """Per live process of one process group: its command line and CPU time so far."""
    found: dict[int, tuple[str, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = _stat_fields(entry)
            if int(fields[2]) != pgid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue  # exited meanwhile
        found[int(entry)] = (cmdline, _fields_cpu_seconds(fields))
    return found


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class ProcessGroup:
    """Starts children in their own sessions and stops all of them (see module docstring)."""

    def __init__(self, log_dir: str | Path, term_timeout_s: float = 5.0) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.term_timeout_s = term_timeout_s
        self.children: list[Child] = []

    def start(
        self,
        name: str,
        cmd: Sequence[str],
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        cpus: Sequence[int] | None = None,
    ) -> Child:
        """Start ``cmd``; with ``cpus``, it and every process it starts run only on those
        CPUs (set in the child before it runs, so its own children inherit it)."""
        log = self.log_dir / f"{name}.log"
        pin = None if cpus is None else _pinner(tuple(cpus))
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                list(cmd),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                cwd=cwd,
                start_new_session=True,
                preexec_fn=pin,
            )
        child = Child(name, popen, log)
        self.children.append(child)
        return child

    def stop(self, child: Child) -> None:
        """SIGTERM the child's process group, wait, then SIGKILL it."""
        p = child.popen
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=self.term_timeout_s)
        # Grandchildren may outlive a parent that exited on SIGTERM: kill the group anyway.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=self.term_timeout_s)
        if child in self.children:
            self.children.remove(child)

    def stop_all(self) -> None:
        for child in reversed(list(self.children)):
            self.stop(child)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_all()


def _pinner(cpus: tuple[int, ...]) -> Callable[[], None]:
    def pin() -> None:
        os.sched_setaffinity(0, cpus)

    return pin


@contextlib.contextmanager
def pinned(cpus: Sequence[int] | None) -> Iterator[None]:
    """This process on ``cpus`` meanwhile (no change when None)."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def pin_process(pid: int, cpus: Sequence[int]) -> None:
    """Every thread of process ``pid`` on ``cpus`` (threads started before a
    ``sched_setaffinity(pid)`` keep their old mask, so each is pinned by its own id)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return  # exited meanwhile
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(tid, cpus)


def split_cpus(router_cpus: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(router's CPUs, everyone else's): the given ones and the rest of this process's.

    Raises ValueError when a CPU is not available here or none would be left."""
    mine = sorted(os.sched_getaffinity(0))
    router = tuple(sorted(set(router_cpus)))
    missing = [c for c in router if c not in mine]
    if missing or not router:
        raise ValueError(f"CPUs {missing or list(router_cpus)} not available (have {mine})")
    rest = tuple(c for c in mine if c not in router)
    if not rest:
        raise ValueError(f"no CPU left for the fleet and the client (have {mine})")
    return router, rest


def group_alive(pgid: int) -> bool:
    """True if any process of group ``pgid`` still exists (for leak checks)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
