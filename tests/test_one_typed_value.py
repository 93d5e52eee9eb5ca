"""Issue 43's "one typed value": past the boundary the schedule is a ScheduleSpec and a data source a DataSource,
each parsed in one module.

Read from the Python sources of models/, app/, worker/ and bench/: an f-string that spells `dtp:{…}` from a δ
anywhere but the schedule grammar (models/schedules/: `dtp_spec`, `dtp_text` and the dtp preset's format) is a
second encoding of the schedule; a `startswith("corpus:" | "hf:" | "upload:")` anywhere but the data-source
parser (models/data/source.py: `parse_data_source`, `is_upload`) is a source parsed by hand at its use site.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("models", "app", "worker", "bench")
GRAMMAR = "models/schedules/"
PARSER = "models/data/source.py"
SOURCE_PREFIXES = ("corpus:", "hf:", "upload:")


def python_files() -> Iterator[tuple[str, ast.AST]]:
    for top in SOURCES:
        for path in sorted((REPO / top).rglob("*.py")):
            yield path.relative_to(REPO).as_posix(), ast.parse(path.read_text(), filename=str(path))


def dtp_fstrings(tree: ast.AST) -> Iterator[int]:
    """Lines of f-strings whose text just before a formatted value ends with `dtp:` (f"dtp:{delta}")."""
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            for before, part in zip(node.values, node.values[1:], strict=False):
                if (isinstance(before, ast.Constant) and isinstance(before.value, str)
                        and before.value.endswith("dtp:") and isinstance(part, ast.FormattedValue)):
                    yield node.lineno


def source_prefix_tests(tree: ast.AST) -> Iterator[int]:
    """Lines of `x.startswith(P)` (or of a tuple holding P) for P a data-source prefix."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "startswith" and node.args):
            continue
        arg = node.args[0]
        values = arg.elts if isinstance(arg, ast.Tuple) else [arg]
        if any(isinstance(v, ast.Constant) and v.value in SOURCE_PREFIXES for v in values):
            yield node.lineno


def test_the_checks_see_what_they_look_for():
    """The two finders on the forms they refuse (so that the tests below cannot pass by seeing nothing)."""
    assert list(dtp_fstrings(ast.parse('x = f"dtp:{delta}"\ny = f"schedule dtp:{d} and"'))) == [1, 2]
    assert list(dtp_fstrings(ast.parse('x = f"δ={delta}"\ny = "dtp:1"'))) == []
    found = ast.parse('a.startswith("corpus:")\nb.startswith(("x", "hf:"))\nc.startswith("upload:")\n'
                      'd.startswith("other:")')
    assert list(source_prefix_tests(found)) == [1, 2, 3]


def test_no_dtp_fallback_outside_the_schedule_grammar():
    found = [f"{path}:{line}" for path, tree in python_files() if not path.startswith(GRAMMAR)
             for line in dtp_fstrings(tree)]
    assert found == [], ("dtp:δ spelt from a δ outside models/schedules/ (use models.schedules.grammar.dtp_spec, "
                         f"or dtp_text where a string travels on): {found}")


def test_no_data_source_parsed_by_hand():
    found = [f"{path}:{line}" for path, tree in python_files() if path != PARSER
             for line in source_prefix_tests(tree)]
    assert found == [], ("a data source tested by its prefix outside models/data/source.py (use "
                         f"parse_data_source(text).kind, or is_upload): {found}")
