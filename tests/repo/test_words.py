"""The project speaks of itself by versions, dates and files in the repository only.

No tracked file may name an internal iteration number ("st" "op 12", the way work was once
counted) or an absolute path of the machine it was written on. A path in /tmp or /home is
legitimate where it is a path inside the container image or a test value, so those few
files are listed with the reason.
"""

from __future__ import annotations

import re

import pytest

from tests.repo.tracked import read_text, tracked_files

# Built from parts so that this file does not match itself.
ITERATION = re.compile(r"\b" + "st" + r"ops? ?[0-9]+", re.IGNORECASE)
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|tmp|home|root)/")

# file -> why absolute paths under /tmp, /home or /root are right there
PATH_ALLOWED = {
    ".gitignore": "ignores a root-level tmp/ folder",
    "deploy/Dockerfile": "paths inside the container image",
    "deploy/requirements.lock": "a throwaway venv in its regeneration command",
    "tests/router/test_config.py": "a file path as a configuration value",
}


def _hits(pattern: re.Pattern[str], skip: dict[str, str]) -> list[str]:
    hits = []
    for path in tracked_files():
        if path in skip:
            continue
        text = read_text(path)
        if text is None:
            continue
        for no, line in enumerate(text.splitlines(), 1):
            m = pattern.search(line)
            if m:
                hits.append(f"{path}:{no}: {line.strip()[:120]}")
    return hits


def test_no_iteration_numbers() -> None:
    hits = _hits(ITERATION, {})
    assert not hits, "iteration numbers in tracked files:\n" + "\n".join(hits)


def test_no_machine_paths() -> None:
    hits = _hits(MACHINE_PATH, PATH_ALLOWED)
    assert not hits, "absolute machine paths in tracked files:\n" + "\n".join(hits)


@pytest.mark.parametrize(
    ("line", "found"),
    [
        ("as before " + "st" + "op 23", True),
        ("St" + "ops 12-14", True),
        ("St" + "op19 final", True),
        ("the engine stops workers", False),
        ("--out-dir " + "/tm" + "p/s28/swa", True),
        ("see " + "/wo" + "rk/main/README.md", True),
        ("bench/results/2026-12-05-routing-heldout-seeds-21-26/", False),
    ],
)
def test_patterns(line: str, found: bool) -> None:
    """The patterns find what they are meant to and leave plain words alone."""
    assert bool(ITERATION.search(line) or MACHINE_PATH.search(line)) is found


def test_allow_list_is_current() -> None:
    """An allow-listed file that no longer needs its exception is taken off the list."""
    stale = []
    for path in PATH_ALLOWED:
        text = read_text(path)
        if text is None or not MACHINE_PATH.search(text):
            stale.append(path)
    assert not stale, f"no absolute paths left in {stale}: remove them from PATH_ALLOWED"
