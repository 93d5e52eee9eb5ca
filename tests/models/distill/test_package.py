"""models.distill: every name callers used from the single module still imports from the package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import models.distill as D

# The public names of models/distill.py before it became a package (app/, worker/, bench/, tests use them).
FORMER_NAMES = [
    "Autocast", "CHECKPOINT_FORMAT", "DenseReference", "DistillError", "DistillRecipe", "DistillSpec", "EvalRecord",
    "LossSums", "METRIC_COLUMNS", "Progress", "RUN_FORMAT", "RunHooks", "RunResult", "STAGE", "STEP_COLUMNS",
    "SUMMARY_FORMAT", "ShouldStop", "StepStats", "WIKITEXT2_TEST", "batch_indices", "distill_run", "eval_steps",
    "evaluate_student", "headline", "iter_records", "learning_rate", "load_data", "loss_and_backward",
    "make_optimizer", "make_student", "multipliers", "next_token_targets", "plot_curves", "reach_step",
    "remove_runs", "resolve_layout", "resolve_layouts", "run_dir_for", "run_distill", "run_fingerprint",
    "summarise", "summary_table", "tensor_fingerprint", "train_step", "trainable_parameters"
]


def test_former_names_import_from_the_package():
    assert set(FORMER_NAMES) <= set(D.__all__)
    for name in FORMER_NAMES:
        exec(f"from models.distill import {name}", {})


def test_every_export_resolves_and_type_checkers_see_the_same_names():
    for name in D.__all__:
        assert getattr(D, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = D.nope
    tree = ast.parse(Path(D.__file__).read_text())
    typed = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.If)
             for stmt in node.body if isinstance(stmt, ast.ImportFrom) for alias in stmt.names}
    assert typed == set(D.__all__)
