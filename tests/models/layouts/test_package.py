"""models.layouts: every public name imports from the package, and the name modules need no numpy."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import models.layouts as layouts
from models.affinity.names import SCORES
from models.io.ids import DTYPE_NAMES, EXPORT_DTYPE_NAMES

REPO = Path(__file__).resolve().parents[3]


def test_every_export_is_the_defining_modules_object():
    for name in layouts.__all__:
        module = importlib.import_module(f"models.layouts.{layouts._EXPORTS[name]}")
        assert getattr(layouts, name) is getattr(module, name), name
        # defined there, not imported there: one definition per name
        tree = ast.parse(Path(module.__file__ or "").read_text())
        defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef)}
        defined |= {t.id for node in tree.body if isinstance(node, ast.Assign | ast.AnnAssign)
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                    if isinstance(t, ast.Name)}
        assert name in defined, f"{name} is exported from {module.__name__}, which does not define it"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = layouts.nope


def test_type_checkers_see_the_same_names():
    tree = ast.parse(Path(layouts.__file__ or "").read_text())
    typed = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.If)
             for stmt in node.body if isinstance(stmt, ast.ImportFrom) for alias in stmt.names}
    assert typed == set(layouts.__all__)


def test_name_modules_import_without_numpy_or_torch():
    """The CLI's help and the API's request checks read these without loading the math."""
    code = """
import sys
sys.modules["numpy"] = sys.modules["torch"] = None  # any import of them now raises ImportError
import models.layouts
from models.layouts.format import LAYOUT_FORMAT, LayoutError
from models.layouts.names import RANDOM_SEED_BASE, canonical_layout_name
from models.affinity.names import SCORES
from models.io.ids import DTYPE_NAMES, EXPORT_DTYPE_NAMES
print(LAYOUT_FORMAT, RANDOM_SEED_BASE, canonical_layout_name("random:7"), SCORES, DTYPE_NAMES, EXPORT_DTYPE_NAMES)
try:
    models.layouts.Layout
except ImportError as exc:
    print("Layout needs numpy:", exc.name)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"{layouts.LAYOUT_FORMAT} {layouts.RANDOM_SEED_BASE} random-7 {SCORES} {DTYPE_NAMES} {EXPORT_DTYPE_NAMES}",
        "Layout needs numpy: numpy",
    ]
