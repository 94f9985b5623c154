"""The user-facing documentation: a short README and links that resolve.

README.md, CHANGELOG.md and every page under docs/ are read as files; nothing is rendered.
The project's words (no iteration numbers, no machine paths) are checked over every tracked
file by tests/repo/test_words.py.
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


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_readme_is_at_most_15000_bytes() -> None:
    # counted in UTF-8 bytes: the README's arrows and box lines take 3 bytes each
    assert len(README.read_bytes()) <= 15_000


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


def test_the_link_check_catches_a_missing_target(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("see [a](missing.md) and [b](https://example.org/x)\n", encoding="utf-8")
    assert _LINK.findall(page.read_text(encoding="utf-8")) == [
        "missing.md",
        "https://example.org/x",
    ]
    assert not (page.parent / "missing.md").exists()
