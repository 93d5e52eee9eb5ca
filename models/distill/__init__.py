"""Distilling a DTP model from the dense one, and comparing layouts by how fast they get there (§4–5).

Student: the DTP simulator (L, δ) over the permuted weights of a layout; teacher: the frozen dense
model. One module per concept:

    recipe.py      every number of the training, the paper's by default (torch-free)
    spec.py        a layout comparison: layouts, data, L, δ, seeds, recipe
    schedule.py    the lr schedule (torch-free)
    data.py        training/evaluation blocks and the seeded block order
    student.py     the student over a permuted fp32 copy of the teacher; autocast
    loss.py        KL + w·CE chunked over tokens, with its hand-formed gradient (shared with eval)
    train.py       one optimiser step
    evaluation.py  the teacher's reference on held-out blocks; KL and perplexity of a student
    records.py     a run's metrics.csv / steps.csv / metrics.json
    checkpoint.py  a run's checkpoint and fingerprint
    run.py         one (layout, seed) run: loop, evaluations, checkpoints, resume
    report.py      curves, headline multipliers, summary and table
    plot.py        the curves figure
    compare.py     every run of a spec, then summary.json, metrics.csv and curves.png

Every public name is importable from `models.distill`; the submodules load on first use, so
`import models.distill` and `models.distill.recipe` stay torch-free (the API process uses them).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> submodule that defines it
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("Autocast", "DistillError", "DistillRecipe", "EVAL_SEQUENCES", "FieldRule", "LastScale",
                     "SEQ_LEN", "WIKITEXT2_TEST"), "recipe"),
    "DistillSpec": "spec",
    "learning_rate": "schedule",
    **dict.fromkeys(("batch_indices", "load_data", "place_data"), "data"),
    **dict.fromkeys(("make_student", "trainable_parameters"), "student"),
    **dict.fromkeys(("LossSums", "chunked_kl_nll", "kl_ce_chunk", "loss_and_backward", "next_token_targets"),
                    "loss"),
    **dict.fromkeys(("StepStats", "make_optimizer", "train_step"), "train"),
    **dict.fromkeys(("DenseReference", "evaluate_student"), "evaluation"),
    **dict.fromkeys(("EvalRecord", "METRIC_COLUMNS", "RUN_FORMAT", "STEP_COLUMNS"), "records"),
    **dict.fromkeys(("CHECKPOINT_FORMAT", "run_fingerprint", "tensor_fingerprint"), "checkpoint"),
    **dict.fromkeys(("RunHooks", "RunResult", "STAGE", "distill_run", "eval_steps"), "run"),
    **dict.fromkeys(("SUMMARY_FORMAT", "headline", "iter_records", "mean_curves", "multipliers", "reach_step",
                     "summarise", "summary_table"), "comparison.report"),
    "plot_curves": "comparison.plot",
    **dict.fromkeys(("remove_runs", "resolve_layouts", "run_dir_for", "run_distill"), "comparison.compare"),
}
# Shared with the rest of the package, re-exported here where distillation callers used to find them.
_ELSEWHERE: dict[str, str] = {
    "resolve_layout": "models.layouts.resolve",
    "Progress": "models.base.progress",
    "ShouldStop": "models.base.progress",
}

__all__ = sorted([*_EXPORTS, *_ELSEWHERE])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
    elif name in _ELSEWHERE:
        module = importlib.import_module(_ELSEWHERE[name])
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:  # what __getattr__ resolves, for type checkers
    from models.base.progress import Progress as Progress
    from models.base.progress import ShouldStop as ShouldStop
    from models.distill.checkpoint import CHECKPOINT_FORMAT as CHECKPOINT_FORMAT
    from models.distill.checkpoint import run_fingerprint as run_fingerprint
    from models.distill.checkpoint import tensor_fingerprint as tensor_fingerprint
    from models.distill.comparison.compare import remove_runs as remove_runs
    from models.distill.comparison.compare import resolve_layouts as resolve_layouts
    from models.distill.comparison.compare import run_dir_for as run_dir_for
    from models.distill.comparison.compare import run_distill as run_distill
    from models.distill.comparison.plot import plot_curves as plot_curves
    from models.distill.comparison.report import SUMMARY_FORMAT as SUMMARY_FORMAT
    from models.distill.comparison.report import headline as headline
    from models.distill.comparison.report import iter_records as iter_records
    from models.distill.comparison.report import mean_curves as mean_curves
    from models.distill.comparison.report import multipliers as multipliers
    from models.distill.comparison.report import reach_step as reach_step
    from models.distill.comparison.report import summarise as summarise
    from models.distill.comparison.report import summary_table as summary_table
    from models.distill.data import batch_indices as batch_indices
    from models.distill.data import load_data as load_data
    from models.distill.data import place_data as place_data
    from models.distill.evaluation import DenseReference as DenseReference
    from models.distill.evaluation import evaluate_student as evaluate_student
    from models.distill.loss import LossSums as LossSums
    from models.distill.loss import chunked_kl_nll as chunked_kl_nll
    from models.distill.loss import kl_ce_chunk as kl_ce_chunk
    from models.distill.loss import loss_and_backward as loss_and_backward
    from models.distill.loss import next_token_targets as next_token_targets
    from models.distill.recipe import EVAL_SEQUENCES as EVAL_SEQUENCES
    from models.distill.recipe import SEQ_LEN as SEQ_LEN
    from models.distill.recipe import WIKITEXT2_TEST as WIKITEXT2_TEST
    from models.distill.recipe import Autocast as Autocast
    from models.distill.recipe import DistillError as DistillError
    from models.distill.recipe import DistillRecipe as DistillRecipe
    from models.distill.recipe import FieldRule as FieldRule
    from models.distill.recipe import LastScale as LastScale
    from models.distill.records import METRIC_COLUMNS as METRIC_COLUMNS
    from models.distill.records import RUN_FORMAT as RUN_FORMAT
    from models.distill.records import STEP_COLUMNS as STEP_COLUMNS
    from models.distill.records import EvalRecord as EvalRecord
    from models.distill.run import STAGE as STAGE
    from models.distill.run import RunHooks as RunHooks
    from models.distill.run import RunResult as RunResult
    from models.distill.run import distill_run as distill_run
    from models.distill.run import eval_steps as eval_steps
    from models.distill.schedule import learning_rate as learning_rate
    from models.distill.spec import DistillSpec as DistillSpec
    from models.distill.student import make_student as make_student
    from models.distill.student import trainable_parameters as trainable_parameters
    from models.distill.train import StepStats as StepStats
    from models.distill.train import make_optimizer as make_optimizer
    from models.distill.train import train_step as train_step
    from models.layouts.resolve import resolve_layout as resolve_layout
