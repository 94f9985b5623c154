"""The peer routers (``smg``, ``vllm-router``) in their own virtual environment.

They are PyPI wheels with a Rust binary. They go into ``.venv-peers`` (next to ``.venv``),
never into kvroute's environment: ``make bench-peers`` or :func:`ensure_peers` builds it
from ``bench/requirements-peers.txt``. Benchmarks that cannot get them run without them and
say so in their results.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
REQUIREMENTS = Path(__file__).resolve().parent / "requirements-peers.txt"
DEFAULT_VENV = ROOT / ".venv-peers"


@dataclass(frozen=True)
class Peers:
    """Where the peer binaries are (None = not available, with the reason)."""

    smg: Path | None
    vllm_router: Path | None
    note: str = ""


def find_peers(venv: Path = DEFAULT_VENV) -> Peers:
    """The binaries of an existing peers venv (does not install anything)."""
    smg = venv / "bin" / "smg"
    vr = venv / "bin" / "vllm-router"
    stamp = venv / ".installed"
    if not stamp.exists():
        return Peers(None, None, f"{venv} not built (run `make bench-peers`)")
    return Peers(smg if smg.exists() else None, vr if vr.exists() else None)


def ensure_peers(venv: Path = DEFAULT_VENV, timeout_s: float = 900.0) -> Peers:
    """Build the peers venv if needed (pip, from PyPI), then return :func:`find_peers`."""
    stamp = venv / ".installed"
    if stamp.exists() and stamp.stat().st_mtime >= REQUIREMENTS.stat().st_mtime:
        return find_peers(venv)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", "-r", str(REQUIREMENTS)],
            check=True,
            timeout=timeout_s,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        return Peers(None, None, f"could not install peer routers: {exc}")
    stamp.touch()
    return find_peers(venv)


def main() -> int:
    peers = ensure_peers()
    print(f"smg: {peers.smg}\nvllm-router: {peers.vllm_router}\n{peers.note}".rstrip())
    return 0 if peers.smg and peers.vllm_router else 1


if __name__ == "__main__":
    raise SystemExit(main())
