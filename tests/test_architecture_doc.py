"""docs/architecture.md says true things about where code lives (issue 43): every path it names exists, and every
extension point it names (`symbol` in `path.py`) is defined in that file.

Read from the doc itself, so a rename that leaves the doc behind fails here:
- a path under models/, app/, worker/, tests/, docs/ or bench/ exists (`<name>` stands for any file there);
- in "Where to add", each backticked name of a bullet is defined (a module-level def, class or assignment, or a
  field of a class) in one of the files that bullet names;
- elsewhere, a name written beside its file, "`name` (`path.py`" or "`path.py` `name`", is defined in that file.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
PATH = re.compile(r"\b(?:models|app|worker|tests|docs|bench)/[\w./<>-]*[\w/>]")
NAME = re.compile(r"`([A-Za-z_]\w*)`")
NAME_THEN_FILE = re.compile(r"`([A-Za-z_]\w*)` \(`([\w/]+\.py)`")
FILE_THEN_NAME = re.compile(r"`([\w/]+\.py)` `([A-Za-z_]\w*)`")


def files_named(path: str) -> list[Path]:
    """The files `path` names (`<name>` is any file of its folder)."""
    if "<" in path:
        return sorted(REPO.glob(re.sub(r"<[^>]+>", "*", path)))
    return [REPO / path]


def defined_in(path: Path) -> set[str]:
    """Names a file defines: module-level functions, classes and assignments, and the fields and methods of its
    classes."""
    names: set[str] = set()

    def collect(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)

    tree = ast.parse(path.read_text(), filename=str(path))
    collect(tree.body)
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            collect(node.body)
    return names


def where_to_add(doc: str) -> list[str]:
    """The bullets of the doc's "Where to add" section, each joined onto one line."""
    section = doc.split("## Where to add", 1)[1].split("\n## ", 1)[0]
    return [" ".join(b.split()) for b in re.split(r"\n- ", "\n" + section.strip()) if b.strip()]


def missing_paths(doc: str) -> list[str]:
    return sorted({p for p in PATH.findall(doc) if not any(f.exists() for f in files_named(p.rstrip(".")))})


def undefined_extension_points(doc: str) -> list[str]:
    out = []
    for bullet in where_to_add(doc):
        files = [f for p in PATH.findall(bullet) if p.endswith(".py") for f in files_named(p)]
        defined = set().union(*(defined_in(f) for f in files if f.is_file()))
        out += [f"{name} (in none of {', '.join(PATH.findall(bullet))})" for name in NAME.findall(bullet)
                if name not in defined]
    return out


def undefined_named_beside_their_file(doc: str) -> tuple[int, list[str]]:
    pairs = [*NAME_THEN_FILE.findall(doc), *((n, p) for p, n in FILE_THEN_NAME.findall(doc))]
    return len(pairs), [f"{name} in {path}" for name, path in pairs
                        if not (REPO / path).is_file() or name not in defined_in(REPO / path)]


def test_every_path_the_doc_names_exists():
    doc = DOC.read_text()
    assert len(PATH.findall(doc)) > 40
    assert missing_paths(doc) == []


def test_every_extension_point_is_defined_where_the_doc_says():
    doc = DOC.read_text()
    bullets = where_to_add(doc)
    assert len(bullets) >= 5 and sum(len(NAME.findall(b)) for b in bullets) >= 6
    assert undefined_extension_points(doc) == []


def test_every_name_written_beside_its_file_is_defined_there():
    count, undefined = undefined_named_beside_their_file(DOC.read_text())
    assert count >= 5 and undefined == []


@pytest.mark.parametrize(("text", "problem"), [
    ("## Where to add\n- **a preset**: a `Nope` class in `models/schedules/presets.py`.\n",
     "Nope (in none of models/schedules/presets.py)"),
    ("## Where to add\n- **a family**: `models/families/<name>.py` (a `FAMILI` record).\n",
     "FAMILI (in none of models/families/<name>.py)"),
])
def test_a_stale_extension_point_is_caught(text: str, problem: str):
    assert undefined_extension_points(text) == [problem]
    fixed = text.replace("Nope", "Preset").replace("FAMILI", "FAMILY")
    assert undefined_extension_points(fixed) == []


def test_a_stale_path_or_name_is_caught():
    assert missing_paths("see `models/schedules/spd_auto.py` and models/layouts/") == ["models/schedules/spd_auto.py"]
    assert undefined_named_beside_their_file("`run_job` (`worker/jobs.py`)") == (1, ["run_job in worker/jobs.py"])
    assert undefined_named_beside_their_file("`run_job` (`worker/entry.py`)") == (1, [])
