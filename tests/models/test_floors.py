"""The floor order inside models/ (issue 43), read from docs/architecture.md and checked over every import.

Each package of models/ stands on one floor of the list the doc writes down (`## Floors inside models/`);
a module may import its own package and the packages on floors below its own, never one on its own floor
or above. Every import counts: at module level, inside a function (a lazy import is still a dependency,
only a later one) and under `if TYPE_CHECKING:` (a type is a dependency too). A package on disk that the
list does not place fails, so a new package is given a floor when it is added.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
SECTION = "## Floors inside models/"


def floors_of(doc: str) -> dict[str, int]:
    """package -> floor, from the doc's fenced list under SECTION (lines `N  pkg, pkg`, top floor first)."""
    section = doc.split(SECTION, 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    floors: dict[str, int] = {}
    for line in block.strip().splitlines():
        match = re.fullmatch(r"\s*(\d+)\s+(.+?)\s*", line)
        assert match, f"{DOC.name}: not a floor line (`N  package, package`): {line!r}"
        for name in match[2].split(","):
            assert name.strip() not in floors, f"{name.strip()} is on two floors"
            floors[name.strip()] = int(match[1])
    return floors


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, dotted name) for every import anywhere in the file: functions and TYPE_CHECKING blocks included."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[:len(package) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from models import variants` names a package: count each imported name under the base too
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def floor_breaches(root: Path, floors: dict[str, int]) -> list[str]:
    """Every import in root/models running sideways or up the floors, as `module:line imports name (a → b)`."""
    out = []
    for path in sorted((root / "models").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if len(parts) < 2:
            continue  # models/__init__.py stands on no floor: it imports nothing
        module, own = ".".join(parts), parts[1]
        for line, name in imports_of(path, module):
            target = name.split(".")
            if target[0] != "models" or len(target) < 2 or target[1] == own or target[1] not in floors:
                continue
            if floors[target[1]] >= floors[own]:
                out.append(f"{module}:{line} imports {name} ({own} on floor {floors[own]} → {target[1]} on "
                           f"floor {floors[target[1]]})")
    return out


def packages(root: Path) -> set[str]:
    return {p.parent.name for p in (root / "models").glob("*/__init__.py")}


def test_every_package_of_models_has_a_floor():
    floors = floors_of(DOC.read_text())
    assert packages(REPO) - set(floors) == set(), f"give these packages a floor in {DOC.relative_to(REPO)}"
    # the ground floor: floor 0 alone, so base imports nothing of models/ (any import would run sideways)
    assert [name for name, floor in floors.items() if floor == 0] == ["base"]


def test_no_import_runs_sideways_or_up_the_floors():
    assert floor_breaches(REPO, floors_of(DOC.read_text())) == []


def test_the_layouts_package_loads_nothing_lazily():
    # its old `__getattr__` dodged a circle the floors no longer allow
    tree = ast.parse((REPO / "models" / "layouts" / "__init__.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / "models" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(("files", "breach"), [
    # at module level, up one floor
    ({"low/a.py": "from models.high.b import B\n"}, "models.low.a:1 imports models.high.b.B (low on floor 0 → high"),
    # deferred into a function: still a dependency
    ({"low/a.py": "def f():\n    import models.high.b\n"}, "models.low.a:2 imports models.high.b (low"),
    # a type-only import counts too
    ({"low/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from models.high import b\n"},
     "models.low.a:3 imports models.high.b (low"),
    # sideways, onto a package of the same floor
    ({"high/a.py": "from models.side import s\n"}, "models.high.a:1 imports models.side.s (high on floor 1 → side"),
    # relative imports resolve against the importing module's package
    ({"low/sub/__init__.py": "", "low/sub/a.py": "from ...high.b import B\n"},
     "models.low.sub.a:1 imports models.high.b.B"),
])
def test_breaches_are_found(tmp_path: Path, files: dict[str, str], breach: str):
    _write(tmp_path, {"__init__.py": "", "low/__init__.py": "", "high/__init__.py": "", "side/__init__.py": "",
                      "high/b.py": "from models.low import a\nB = 1\n", **files})
    found = floor_breaches(tmp_path, {"low": 0, "high": 1, "side": 1})
    assert len(found) == 1 and found[0].startswith(breach), found


def test_the_floor_list_is_read_from_the_doc():
    doc = f"x\n{SECTION}\ntext\n```\n2  top\n1  mid, side\n0  base\n```\n## Next\n```\n9 no\n```\n"
    assert floors_of(doc) == {"top": 2, "mid": 1, "side": 1, "base": 0}
    with pytest.raises(AssertionError, match="two floors"):
        floors_of(doc.replace("0  base", "0  base, top"))
