"""The whole comparison: every (layout, seed) run of a spec, then the summary, table and figure.

Each run keeps its own directory under out_dir/runs/LAYOUT/seed-SEED (see `models.distill.run`);
out_dir gets `metrics.csv` (every evaluation of every run, rewritten as they come), `summary.json`
and `curves.png`. Rerunning with the same spec and out_dir skips finished runs and resumes the
interrupted one.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import nn

from models.base.progress import Progress, ShouldStop
from models.base.shapes import ModelShape
from models.distill.comparison.plot import plot_curves
from models.distill.comparison.report import summarise
from models.distill.data import load_data, place_data
from models.distill.evaluation import DenseReference
from models.distill.recipe import DistillError
from models.distill.records import EvalRecord, write_metrics
from models.distill.run import STAGE, RunWork, distill_run, reference_work
from models.distill.sharding import launch_rank
from models.distill.spec import DistillSpec
from models.distill.train import StepStats
from models.families import model_shape
from models.io.atomic import atomic_write_text
from models.layouts.layout import Layout
from models.layouts.resolve import resolve_layout


def resolve_layouts(names: Sequence[str], *, shape: ModelShape, devices: int, delta: int,
                    layouts_dir: Path | None = None) -> dict[str, Layout]:
    """Each name resolved by `models.layouts.resolve.resolve_layout`, keyed by the layout's name."""
    layouts: dict[str, Layout] = {}
    for name in names:
        lay = resolve_layout(name, shape=shape, devices=devices, delta=delta, layouts_dir=layouts_dir)
        if lay.name in layouts:
            raise DistillError(f"layouts: two entries are named {lay.name!r}")
        layouts[lay.name] = lay
    return layouts


def run_dir_for(out_dir: Path, layout: str, seed: int) -> Path:
    return Path(out_dir) / "runs" / layout.replace("/", "_") / f"seed-{seed}"


def run_distill(spec: DistillSpec, *, teacher: nn.Module, tokenizer: Any, out_dir: Path,
                layouts_dir: Path | None = None, model_id: str = "", progress: Progress | None = None,
                should_stop: ShouldStop | None = None, on_eval: Callable[[EvalRecord], None] | None = None,
                on_step: Callable[[str, int, StepStats, EvalRecord | None], None] | None = None,
                on_run_start: Callable[[str, int], None] | None = None, plot: bool = True,
                keep_checkpoints: bool = True,
                abandonable: Callable[[Callable[[], Any]], Any] | None = None,
                on_eval_student: Callable[[EvalRecord, nn.Module], None] | None = None) -> dict[str, Any]:
    """Every (layout, seed) run of `spec`, in order; writes out_dir/{metrics.csv, summary.json, curves.png}.

    Rerunning with the same spec and out_dir skips finished runs and resumes the interrupted one.
    progress(stage, fraction) counts the work done (`models.distill.run.RunWork`): the dense reference, then
    each run's steps and evaluations. Returns the summary.
    should_stop is asked between the dense model's evaluation batches, steps, micro-batches and
    evaluation batches; abandonable(fn) runs the data loading (which asks nothing): the worker passes
    a wrapper that a cancel can walk away from.
    Under torchrun every rank calls this: only rank 0 writes out_dir's files and calls the callbacks
    (`models.distill.sharding.launch_rank`); every rank returns the summary. on_eval_student: passed to each
    run (`distill_run`).
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    writer = launch_rank() == 0
    if not writer:  # another rank of a torchrun launch: the same runs, with no output, bar nor callback
        progress = on_eval = on_step = on_run_start = None
        plot = False
    out_dir.mkdir(parents=True, exist_ok=True)
    teacher.eval()
    config: Any = teacher.config
    layouts = resolve_layouts(spec.layouts, shape=model_shape(config), devices=spec.devices, delta=spec.delta,
                              layouts_dir=layouts_dir)
    vocab = int(config.vocab_size)

    def read() -> Any:  # where the data are (identities read by content), then the blocks
        placement = place_data(spec)
        return (placement, *load_data(spec, tokenizer=tokenizer, vocab_size=vocab, placement=placement))

    placement, train_blocks, eval_blocks = abandonable(read) if abandonable is not None else read()
    spec = replace(spec, train=placement.train or spec.train, eval=placement.eval)  # what was read
    pairs = [(name, seed) for name in layouts for seed in spec.seeds]
    run_work = RunWork.of(spec.recipe, train_blocks.shape[1], eval_blocks.numel()).total
    before_runs = reference_work(eval_blocks.numel())
    total = before_runs + len(pairs) * run_work

    def reference_done(fraction: float) -> None:
        if progress:
            progress(STAGE, fraction * before_runs / total)

    reference = DenseReference.compute(teacher, eval_blocks, recipe=spec.recipe, should_stop=should_stop,
                                       done=reference_done)
    records: list[EvalRecord] = []

    def record(rec: EvalRecord) -> None:
        records[:] = [r for r in records if (r.layout, r.seed, r.step) != (rec.layout, rec.seed, rec.step)]
        records.append(rec)
        if writer:
            write_metrics(out_dir, records)
        if on_eval:
            on_eval(rec)

    def restored(earlier: list[EvalRecord]) -> None:
        for rec in earlier:
            records[:] = [r for r in records if (r.layout, r.seed, r.step) != (rec.layout, rec.seed, rec.step)]
        records.extend(earlier)
        if writer:
            write_metrics(out_dir, records)

    for index, (name, seed) in enumerate(pairs):
        def run_progress(stage: str, fraction: float, index: int = index) -> None:
            if progress:
                progress(stage, (before_runs + (index + fraction) * run_work) / total)

        def step_hook(stats: StepStats, last: EvalRecord | None, name: str = name, seed: int = seed) -> None:
            if on_step:
                on_step(name, seed, stats, last)

        if on_run_start:
            on_run_start(name, seed)
        result = distill_run(teacher=teacher, layout=layouts[name], seed=seed, recipe=spec.recipe,
                             train_blocks=train_blocks, reference=reference,
                             run_dir=run_dir_for(out_dir, name, seed), model_id=model_id, progress=run_progress,
                             should_stop=should_stop, on_eval=record, on_step=step_hook, on_restore=restored,
                             keep_checkpoint=keep_checkpoints, world_size=spec.world_size,
                             schedule=spec.run_schedule, on_eval_student=on_eval_student)
        records[:] = [r for r in records if (r.layout, r.seed) != (name, seed)] + result.records
        if writer:
            write_metrics(out_dir, records)
    summary = summarise(records, spec=spec, dense_ppl=reference.dense_ppl, model_id=model_id, layouts=layouts,
                        seconds=time.perf_counter() - t0)
    summary["data"] = placement.as_dict()
    if writer:
        atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=1))
    if plot:
        plot_curves(summary, out_dir / "curves.png")
    return summary


def remove_runs(out_dir: Path) -> None:
    """Forget every run under out_dir (for --overwrite)."""
    shutil.rmtree(Path(out_dir) / "runs", ignore_errors=True)
    for name in ("metrics.csv", "summary.json", "curves.png"):
        (Path(out_dir) / name).unlink(missing_ok=True)
