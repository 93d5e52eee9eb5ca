"""The shape issue 27 set for the source tree: a newcomer finds each concept in a package named after it.

- no folder of models/, app/ or worker/ holds more than 14 flat modules (`__init__.py` aside);
- every package says what it owns in its `__init__` docstring;
- no source file of models/, app/ or worker/ is over 600 lines;
- no code outside app/core/storage/ asks which object-store backend it holds (`isinstance` on LocalStore
  or S3Store): what differs between backends is a method of the ObjectStore protocol.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("models", "app", "worker")
MAX_FLAT_MODULES = 14
MAX_LINES = 600


def _packages() -> list[Path]:
    return sorted(p.parent for root in ROOTS for p in (REPO / root).rglob("__init__.py")
                  if "__pycache__" not in p.parts)


@pytest.mark.parametrize("package", _packages(), ids=lambda p: str(p.relative_to(REPO)))
def test_each_package_is_small_and_says_what_it_owns(package: Path):
    modules = [p.name for p in package.glob("*.py") if p.name != "__init__.py"]
    assert len(modules) <= MAX_FLAT_MODULES, f"{package.relative_to(REPO)} holds {len(modules)} modules: {modules}"
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
    assert doc and len(doc.split()) >= 5, f"{package.relative_to(REPO)}/__init__.py: no docstring saying what it owns"


def _backend_checks(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} if len(node.args) > 1 else set()
            if names & {"LocalStore", "S3Store"}:
                lines.append(node.lineno)
    return lines


def test_no_code_outside_storage_branches_on_the_backend():
    storage = REPO / "app" / "core" / "storage"
    found = {str(p.relative_to(REPO)): lines for root in ROOTS for p in (REPO / root).rglob("*.py")
             if storage not in p.parents and (lines := _backend_checks(p))}
    assert found == {}


def test_no_source_file_is_over_600_lines():
    long = {str(p.relative_to(REPO)): n for root in ROOTS for p in (REPO / root).rglob("*.py")
            if "__pycache__" not in p.parts and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
