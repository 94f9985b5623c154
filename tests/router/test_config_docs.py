"""docs/configuration.md is generated from the config model and kept fresh; help lines are short.

The committed reference is compared with a fresh rendering, so a new key, a changed default or
an edited help line without `kvroute serve --print-config-docs > docs/configuration.md` fails
here. Help lines say what a key means, its unit and range, in at most two lines: no experiment
history and no results folders (those belong in the results and docs).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from kvroute.cli import main as kvroute_main
from kvroute.router import config
from kvroute.router.cli import build_parser
from kvroute.router.config_docs import render_markdown
from kvroute.router.config_load import env_overrides

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"
# Words of experiment reports, not of a key's meaning.
HISTORY = re.compile(
    r"bench/|results|benchmark|\bseeds\b|README|p50|p99|oracle|\bsmg\b|tuned|measured no",
    re.IGNORECASE,
)
MAX_HELP_CHARS = 200  # two lines of a 100-column terminal


def _records() -> list[Any]:
    return [
        obj
        for obj in vars(config).values()
        if isinstance(obj, type)
        and dataclasses.is_dataclass(obj)
        and obj.__module__ == config.__name__
    ]


def _docs() -> list[tuple[str, str]]:
    return [
        (f"{cls.__name__}.{f.name}", str(f.metadata.get("doc", "")))
        for cls in _records()
        for f in dataclasses.fields(cls)
    ]


def test_committed_reference_is_fresh() -> None:
    expected = render_markdown(build_parser())
    assert DOC.read_text(encoding="utf-8") == expected, (
        "docs/configuration.md is stale: run "
        "`kvroute serve --print-config-docs > docs/configuration.md`"
    )


def test_print_config_docs_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvroute_main(["serve", "--print-config-docs"]) == 0
    assert capsys.readouterr().out == render_markdown(build_parser())


def test_every_key_is_in_the_reference() -> None:
    text = render_markdown(build_parser())
    for name, _ in _docs():
        key = name.split(".")[1]
        assert f"| `{key}` |" in text or f"## `{key}`" in text, name


def test_help_lines_are_short_and_say_what_a_key_means() -> None:
    assert len(_docs()) > 80  # every record of the module was found
    problems = []
    for name, doc in _docs():
        if not doc.strip():
            problems.append(f"{name}: no help")
        elif len(doc) > MAX_HELP_CHARS:
            problems.append(f"{name}: {len(doc)} characters")
        elif HISTORY.search(doc):
            problems.append(f"{name}: experiment history ({HISTORY.search(doc)})")
    assert not problems, "\n".join(problems)


def test_history_pattern_catches_report_words() -> None:
    assert HISTORY.search("sliding window p50 -4.0 ms, bench/results/2026-12-04-x")
    assert HISTORY.search("on the routing benchmark it measured no better")
    assert not HISTORY.search("weight of a worker's queued prefill in the TTFT estimate (>= 0)")


def test_environment_names_in_the_reference_are_the_ones_the_loader_reads() -> None:
    text = render_markdown(build_parser())
    names = re.findall(r"`(KVROUTE_[A-Z0-9_]+)`", text)
    assert "KVROUTE_POLICY__QUEUE_WEIGHT" in names
    for env_name in names:
        if env_name == "KVROUTE_CONFIG":
            continue
        parsed = env_overrides({env_name: "1"})
        assert parsed, f"{env_name} is not read by the loader"


def test_policy_flag_lists_its_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        kvroute_main(["serve", "--help"])
    help_text = capsys.readouterr().out
    for name in config.POLICY_NAMES:
        assert name in help_text
    assert "{" + ",".join(config.POLICY_NAMES) + "}" in help_text
