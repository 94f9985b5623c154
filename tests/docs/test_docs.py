"""The user-facing documentation: a short README, links that resolve, and project words only.

README.md, CHANGELOG.md and every page under docs/ are read as files; nothing is rendered.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]

# A Markdown link or image target, without its #fragment: [text](target#frag).
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# Internal iteration numbers ("stop 26", "stops 26-27") are not the project's vocabulary.
_ITERATION = re.compile(r"stops? ?[0-9]+", re.IGNORECASE)
# Absolute paths of a build machine.
_MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|tmp|home|root)/")


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_readme_is_at_most_15000_characters() -> None:
    assert len(README.read_text(encoding="utf-8")) <= 15_000


def test_readme_keeps_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert "make demo     # installs what it needs, then runs the built-in demo" in text
    assert "make test     # installs what it needs and runs every check and test" in text


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_relative_link_resolves(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    targets = [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:", t)]
    missing = [t for t in targets if not (page.parent / t).exists()]
    assert missing == [], f"{_page_id(page)} links to files that are not in the repository"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_no_iteration_numbers_nor_machine_paths(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert _ITERATION.findall(text) == []
    assert _MACHINE_PATH.findall(text) == []


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    """The patterns above find a broken link, an iteration number and a machine path."""
    page = tmp_path / "page.md"
    page.write_text("[a](missing.md) measured in stop 26 under /work/main\n", encoding="utf-8")
    text = page.read_text(encoding="utf-8")
    assert _LINK.findall(text) == ["missing.md"]
    assert not (page.parent / "missing.md").exists()
    assert _ITERATION.findall(text) == ["stop 26"]
    assert _MACHINE_PATH.findall(text) == ["/work/"]
