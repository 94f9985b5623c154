"""`pip install .` installs only the `kvroute` package: the wheel's contents.

The wheel is built (offline, with the build backend already installed) from a copy of the
tracked files, so neither the work tree's leftovers nor its build directories get in.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest

from tests.repo.tracked import ROOT, tracked_files

PACKAGE_DATA = {".proto", ".pyi", ".json", ".jinja", ".html", ".js", ".css"}


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    src = tmp_path_factory.mktemp("src")
    for path in tracked_files():
        (src / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / path, src / path)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("kvroute-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def test_only_kvroute_at_the_top(wheel_names: list[str]) -> None:
    top = {PurePosixPath(n).parts[0] for n in wheel_names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert len(dist_info) == 1 and next(iter(dist_info)).startswith("kvroute-")
    assert top - dist_info == {"kvroute"}


def test_benchmarks_and_tests_are_not_installed(wheel_names: list[str]) -> None:
    for name in wheel_names:
        parts = PurePosixPath(name).parts
        assert "bench" not in parts and "tests" not in parts, name


def test_every_module_and_data_file_is_installed(wheel_names: list[str]) -> None:
    """No module is left out (a folder without __init__.py would be), nor any package data."""
    installed = set(wheel_names)
    wanted = [
        p
        for p in tracked_files("kvroute")
        if p.endswith(".py") or Path(p).suffix in PACKAGE_DATA or p.endswith("py.typed")
    ]
    assert len(wanted) > 100
    missing = [p for p in wanted if p not in installed]
    assert not missing, missing
