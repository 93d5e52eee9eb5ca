"""models/ imports without a circle: the module graph, read from the source, is acyclic.

An edge A → B for every import A makes of B when it runs: at module level and inside functions (an
import deferred into a function is still a circle, only a later one), but not under `if TYPE_CHECKING:`
(never executed). Importing `models.x.y` also runs the package `models.x` first, so an importer outside
that package gets an edge to the package too: an eager `__init__` that imports its submodules closes a
circle through any submodule that imports back into the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `package` under `root` (a package is its __init__)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_only(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_names(module: str, path: Path) -> set[str]:
    """Every dotted name `module` imports when it runs (relative imports made absolute)."""
    out: set[str] = set()
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking_only(child):
                assert isinstance(child, ast.If)
                for stmt in child.orelse:  # the `else:` of `if TYPE_CHECKING:` does run
                    visit_one(stmt)
            else:
                visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here[:len(here) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
        visit(node)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return out


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it makes Python import (including the packages they sit in)."""
    modules = module_files(root, package)
    graph = {}
    for module, path in modules.items():
        targets = set()
        for name in imported_names(module, path):
            parts = name.split(".")
            for k in range(1, len(parts) + 1):
                target = ".".join(parts[:k])
                # A module's own packages are already initialising when it runs: no edge to them.
                if target in modules and target != module and not module.startswith(f"{target}."):
                    targets.add(target)
        graph[module] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_models_import_graph_is_acyclic():
    graph = import_graph(REPO, "models")
    assert len(graph) > 50 and graph["models.layouts.resolve"] >= {"models.layouts.names", "models.layouts.layout"}
    # ModelShape stands on the ground floor (models.base.shapes), so the affinity file needs nothing of
    # models.layouts, and models/layouts/__init__.py loads nothing (its old lazy __getattr__ dodged that circle).
    assert not any(m.startswith("models.layouts") for m in graph["models.affinity.file"])
    assert graph["models.layouts"] == set()
    assert circles(graph) == []


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(("files", "circle"), [
    # the old models/layout.resolve ↔ models/layout_names: deferred into a function, still a circle
    ({"layout.py": "def resolve():\n    from pkg.names import parse\n",
      "names.py": "from pkg.layout import Layout\n"}, ["pkg.layout", "pkg.names"]),
    # an eager package __init__ that imports a submodule which imports an outside module back
    ({"shapes/__init__.py": "from pkg.shapes.score import rescore\n",
      "shapes/shape.py": "X = 1\n",
      "shapes/score.py": "from pkg.file import File\n",
      "file.py": "from pkg.shapes.shape import X\n"}, ["pkg.file", "pkg.shapes", "pkg.shapes.score"]),
    # relative imports resolve against the importing module's package
    ({"a.py": "from . import b\n", "b.py": "from .a import thing\n"}, ["pkg.a", "pkg.b"]),
])
def test_circles_are_found(tmp_path: Path, files: dict[str, str], circle: list[str]):
    _write(tmp_path / "pkg", {"__init__.py": "", **files})
    assert circles(import_graph(tmp_path, "pkg")) == [circle]


def test_type_checking_imports_and_a_lazy_init_are_not_circles(tmp_path: Path):
    _write(tmp_path / "pkg", {
        "__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.shapes.score import s\n",
        "shapes/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from pkg.shapes.score import rescore\n",
        "shapes/shape.py": "X = 1\n",
        "shapes/score.py": "from pkg.file import File\n",
        "file.py": "from pkg.shapes.shape import X\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.file"] == {"pkg.shapes", "pkg.shapes.shape"} and graph["pkg.shapes"] == set()
    assert circles(graph) == []

