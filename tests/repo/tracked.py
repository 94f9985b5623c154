"""The repository's tracked files, for tests that check the repository itself."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tracked_files(*patterns: str) -> list[str]:
    """Paths (relative to the root) of the files git tracks, optionally limited by pathspecs.

    Files deleted in the work tree but not yet committed are left out.
    """
    out = subprocess.run(
        ["git", "ls-files", "-z", "--", *patterns],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [p for p in out.split("\0") if p and (ROOT / p).is_file()]


def read_text(path: str) -> str | None:
    """The file's text, or None for a binary file (one that is not UTF-8)."""
    try:
        return (ROOT / path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None
