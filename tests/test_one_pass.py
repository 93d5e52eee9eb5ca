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


def test_no_second_module_per_pass():
    """No streamed or resident twin of a pass is left (not even one keeping an old name): one module each."""
    for twin in ("affinity/streamed.py", "evaluation/streamed.py", "evaluation/resident.py", "export/streamed.py"):
        assert not (REPO / "models" / twin).exists(), twin
    shard_writers = [p for p in (REPO / "models").rglob("*.py")
                     if "SHARDS_FORMAT," in p.read_text() and '"format": SHARDS_FORMAT' in p.read_text()]
    assert [p.relative_to(REPO) for p in shard_writers] == [Path("models/export/writer.py")]  # one manifest writer


def _builds_streamed(path: Path) -> list[int]:
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and (getattr(node.func, "id", None) == "StreamedModel"
                                                or getattr(node.func, "attr", None) == "StreamedModel")]


def test_the_pipeline_is_chosen_in_one_place():
    """The stage runner and the CLI open a model's weights through `open_weights` (the memory plan's choice):
    no module outside models/streaming/ builds a StreamedModel itself."""
    found = {str(p.relative_to(REPO)): lines for root in ROOTS for p in sorted((REPO / root).rglob("*.py"))
             if "__pycache__" not in p.parts and ALLOWED not in p.parents and (lines := _builds_streamed(p))}
    assert found == {}
    sample = REPO / "models" / "streaming" / "weights.py"
    assert _builds_streamed(sample), "the check finds the one place that builds it"
