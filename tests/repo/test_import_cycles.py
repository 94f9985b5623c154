"""No import cycles between kvroute's modules.

A cycle makes import order matter and the modules in it one unit that cannot be read, tested
or moved alone. The graph counts imports at module level and inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.repo.import_graph import cycles, import_graph, modules


def test_kvroute_has_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 100 and "kvroute.router.app" in graph
    assert "kvroute.router.config" in graph["kvroute.router.app"]
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def _package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_cycles_are_found_through_every_kind_of_import(tmp_path: Path) -> None:
    _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\n",  # a submodule named in `from package import`
            "pkg/b.py": "def f():\n    from .sub import c\n",  # relative, inside a function
            "pkg/sub/__init__.py": "",
            "pkg/sub/c.py": "import pkg.a\n",
            "pkg/d.py": "from pkg.e import thing\n",
            "pkg/e.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg import d\n",
            "pkg/f.py": "from . import g\n",
            "pkg/g.py": "from .f import x\n",
        },
    )
    graph = import_graph("pkg", tmp_path)
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.sub.c"}
    assert graph["pkg.e"] == set()  # type-only imports never run
    assert sorted(cycles(graph)) == [["pkg.a", "pkg.b", "pkg.sub.c"], ["pkg.f", "pkg.g"]]


def test_an_acyclic_package_has_no_cycles(tmp_path: Path) -> None:
    _package(tmp_path, {"pkg/__init__.py": "from pkg import a\n", "pkg/a.py": "import os\n"})
    assert cycles(import_graph("pkg", tmp_path)) == []


def test_installed_code_imports_nothing_that_is_not_installed() -> None:
    """bench/ and tests/ are not in the wheel, so kvroute may not import them."""
    offenders = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module]
            offenders += [f"{name}: {t}" for t in targets if t.split(".")[0] in ("bench", "tests")]
    assert not offenders, offenders
