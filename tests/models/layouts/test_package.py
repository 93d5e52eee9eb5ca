"""models.layouts: importing the package loads nothing (no lazy `__getattr__`: names are imported from the
module that defines them), and the name modules need no numpy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import models.layouts as layouts
from models.affinity.names import SCORES
from models.base.layout_format import LAYOUT_FORMAT
from models.io.ids import DTYPE_NAMES, EXPORT_DTYPE_NAMES
from models.layouts.names import RANDOM_SEED_BASE

REPO = Path(__file__).resolve().parents[3]


def test_the_package_init_is_its_docstring_alone():
    tree = ast.parse(Path(layouts.__file__ or "").read_text())
    assert ast.get_docstring(tree)
    assert [type(node).__name__ for node in tree.body] == ["Expr"], "models/layouts/__init__.py defines or imports"


def test_name_modules_import_without_numpy_or_torch():
    """The CLI's help and the API's request checks read these without loading the math."""
    code = """
import sys
sys.modules["numpy"] = sys.modules["torch"] = None  # any import of them now raises ImportError
import models.layouts
from models.base.layout_format import LAYOUT_FORMAT, LayoutError
from models.layouts.names import RANDOM_SEED_BASE, canonical_layout_name
from models.affinity.names import SCORES
from models.io.ids import DTYPE_NAMES, EXPORT_DTYPE_NAMES
print(LAYOUT_FORMAT, RANDOM_SEED_BASE, canonical_layout_name("random:7"), SCORES, DTYPE_NAMES, EXPORT_DTYPE_NAMES)
print(sorted(m for m in sys.modules if m.startswith("models.layouts.")))
try:
    import models.layouts.layout
except ImportError as exc:
    print("Layout needs numpy:", exc.name)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"{LAYOUT_FORMAT} {RANDOM_SEED_BASE} random-7 {SCORES} {DTYPE_NAMES} {EXPORT_DTYPE_NAMES}",
        "['models.layouts.names']",
        "Layout needs numpy: numpy",
    ]
