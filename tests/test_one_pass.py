"""Issue 27: each pass (affinity, evaluation, export) is written once and fed its layers by a layer source
(`models.streaming.source`); whether the model is streamed is asked nowhere else. No module of models/, app/
or worker/ outside models/streaming/ calls `isinstance(…, StreamedModel)` or `hasattr(…, "reader")` (what
chose the streamed pass before), and the passes have one implementation each."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("models", "app", "worker")
ALLOWED = REPO / "models" / "streaming"  # where the sources are built and told apart (layer_source)


def _asks_streamed(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1):
            continue
        if node.func.id == "isinstance":
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
            if names & {"StreamedModel", "PermutedLayers"}:
                lines.append(node.lineno)
        elif node.func.id == "hasattr" and isinstance(node.args[1], ast.Constant) and node.args[1].value == "reader":
            lines.append(node.lineno)
    return lines


def test_no_pass_asks_whether_its_model_is_streamed():
    found = {str(p.relative_to(REPO)): lines for root in ROOTS for p in sorted((REPO / root).rglob("*.py"))
             if "__pycache__" not in p.parts and ALLOWED not in p.parents and (lines := _asks_streamed(p))}
    assert found == {}


def test_the_check_finds_what_it_looks_for(tmp_path: Path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f(model):\n    if isinstance(model, StreamedModel):\n        pass\n"
                      "    return hasattr(model, 'reader') or isinstance(model, (int, layer_source.StreamedModel))\n")
    assert _asks_streamed(sample) == [2, 4, 4]


def _defines(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef)}


def test_the_streamed_modules_only_keep_the_old_names():
    """models/*/streamed.py (and evaluation/resident.py) define no pass of their own: each calls the one pass."""
    for path, allowed in [(REPO / "models" / "affinity" / "streamed.py", {"streamed_affinity_pass"}),
                          (REPO / "models" / "evaluation" / "streamed.py", set()),
                          (REPO / "models" / "evaluation" / "resident.py", set()),
                          (REPO / "models" / "export" / "streamed.py", {"streamed_export", "checkpoint_names"})]:
        assert _defines(path) <= allowed, path
    shard_writers = [p for p in (REPO / "models").rglob("*.py")
                     if "SHARDS_FORMAT," in p.read_text() and '"format": SHARDS_FORMAT' in p.read_text()]
    assert [p.relative_to(REPO) for p in shard_writers] == [Path("models/export/writer.py")]  # one manifest writer
