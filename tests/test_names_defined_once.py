"""The layout-file format, the random-seed base, the score names, the dtype names, the job status names and
the stage names: each written once.

Every other use imports it. Read from the Python sources of models/, app/, worker/ and bench/ (tests
may spell values out to check them): the format string as a literal, a collection literal holding all
the score, dtype, status or stage names (a dict's keys too), or an assignment to RANDOM_SEED_BASE,
anywhere but in the one defining module, is a restatement that can drift. The dashboard's scripts read
the lists from GET /v1/spec: none of them spells out a list of statuses, stages, scores or dtypes.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from app.core.jobstate import STAGES, STATUSES
from models.affinity.names import SCORES
from models.base.layout_format import LAYOUT_FORMAT
from models.io.ids import DTYPE_NAMES

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("models", "app", "worker", "bench")
SCRIPTS = REPO / "app" / "ui" / "static" / "js"


def python_files() -> Iterator[tuple[str, ast.AST]]:
    for top in SOURCES:
        for path in sorted((REPO / top).rglob("*.py")):
            yield str(path.relative_to(REPO)), ast.parse(path.read_text(), filename=str(path))


def _strings(node: ast.AST) -> set[str]:
    """The string constants a collection literal holds (a dict's keys)."""
    elements = (node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set)
                else node.keys if isinstance(node, ast.Dict) else [])
    return {e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)}


def writers() -> dict[str, list[str]]:
    """What -> every `file:line` that writes it."""
    out: dict[str, list[str]] = {"format": [], "scores": [], "dtypes": [], "seed base": [], "statuses": [],
                                 "stages": []}
    for name, tree in python_files():
        for node in ast.walk(tree):
            line = f"{name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Constant) and node.value == LAYOUT_FORMAT:
                out["format"].append(line)
            if set(SCORES) <= _strings(node):  # a tuple, list, set, dict or a Literal's subscript
                out["scores"].append(line)
            if set(DTYPE_NAMES) <= _strings(node):
                out["dtypes"].append(line)
            if set(STATUSES) <= _strings(node):
                out["statuses"].append(line)
            if set(STAGES) <= _strings(node):
                out["stages"].append(line)
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign) else [])
            if any(isinstance(t, ast.Name) and t.id == "RANDOM_SEED_BASE" for t in targets):
                out["seed base"].append(line)
    return out


def test_each_name_is_written_in_its_one_module():
    found = writers()
    assert {what: sorted({line.split(":")[0] for line in lines}) for what, lines in found.items()} == {
        "format": ["models/base/layout_format.py"],
        "scores": ["models/affinity/names.py"],
        "dtypes": ["models/io/ids.py"],
        "seed base": ["models/layouts/names.py"],
        "statuses": ["app/core/jobstate.py"],
        "stages": ["models/run/stage_names.py"],
    }, found
    assert all(len(lines) == 1 for lines in found.values()), found


def _js_string_lists(text: str) -> list[set[str]]:
    """The strings of each data literal of a script, roughly: every `[...]` / `{...}` (nested ones
    included) that holds no statement (`;`) and no function (`=>`): its quoted strings and `name:` keys."""
    out = []
    opened: list[int] = []
    for at, char in enumerate(text):
        if char in "[{":
            opened.append(at)
        elif char in "]}" and opened:
            body = text[opened.pop() + 1:at]
            if ";" not in body and "=>" not in body:
                out.append(set(re.findall(r"[\"'`]([^\"'`]*)[\"'`]", body)) | set(re.findall(r"(\w+)\s*:", body)))
    return out


def test_the_dashboard_reads_the_names_from_the_server():
    lists = {"statuses": set(STATUSES), "stages": set(STAGES), "scores": set(SCORES), "dtypes": set(DTYPE_NAMES)}
    found = {what: sorted(str(path.relative_to(REPO)) for path in sorted(SCRIPTS.rglob("*.js"))
                          if any(names <= strings for strings in _js_string_lists(path.read_text())))
             for what, names in lists.items()}
    assert found == {what: [] for what in lists}, found
    # and the checker sees a restatement where there is one (the lists as the scripts had them)
    assert any(set(STAGES) <= s for s in _js_string_lists(
        'const C = {queued: "#c", loading: "#8", calibration: "#6", affinity: "#f", optimising: "#e",\n'
        '  probing: "#d", stability: "#b", exporting: "#a", distilling: "#f"};'))
    assert any(set(DTYPE_NAMES) <= s for s in _js_string_lists(
        'select([["float32", "float32"], ["bfloat16", "bfloat16"], ["float16", "float16"]])'))


def _prose_stage_lists(text: str) -> list[list[str]]:
    """Runs of three or more back-quoted stage names in a text (`loading`, `calibration`, … in prose)."""
    quoted = "|".join(re.escape(f"`{stage}`") for stage in STAGES)
    return [re.findall(r"`(\w+)`", run)
            for run in re.findall(rf"(?:(?:{quoted})[^`]{{0,40}}){{3,}}", text)]


def test_the_api_reports_the_stage_list_it_is_given():
    # The OpenAPI description is built from the one list (it once left out `stability`): whatever it
    # names as the stages is the whole list, in order, and no source of app/ spells out a part of it.
    from app.api.main import DESCRIPTION

    assert _prose_stage_lists(DESCRIPTION) == [list(STAGES)]
    partial = [str(path.relative_to(REPO)) for path in sorted((REPO / "app").rglob("*.py"))
               if any(run != list(STAGES) for run in _prose_stage_lists(path.read_text()))]
    assert partial == []
    assert _prose_stage_lists("(`loading`, `calibration`, `affinity`, `optimising`, `exporting`, and `distilling` "
                              "when the spec asks)") == [["loading", "calibration", "affinity", "optimising",
                                                          "exporting", "distilling"]]
