"""`dtp-layout distill`: distil DTP models of several layouts from the dense one and compare the curves.

Registered by `app.cli.main` (see `_EXTENSIONS`). Its flags are the job spec's (models/run/jobspec.py, the recipe's
rules included: app/cli/args/spec_flags.py). Imports nothing heavy at import time; torch and the rest of models.*
load inside the command.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from app.cli.args.model import (
    add_model_args,
    calibration_of,
    check_layout_numbers,
    converted_cache,
    layouts_dir_of,
    model_config,
)
from app.cli.args.schedule import command_schedule, schedule_flags
from app.cli.args.spec_flags import spec_values
from app.cli.extras import needs_worker_extra
from app.cli.run import CliHooks
from models.distill.recipe import DistillRecipe  # torch-free


def _recipe(args: argparse.Namespace) -> DistillRecipe:
    prefix = "distill.recipe."
    return DistillRecipe(**{path.removeprefix(prefix): value for path, value in spec_values(args, "distill").items()
                            if path.startswith(prefix)})


def _spec(args: argparse.Namespace) -> Any:
    from models.data.calibration import CalibrationSpec
    from models.distill import DistillSpec
    schedule = command_schedule(args)  # fills in --delta from a dtp --schedule; a conflict is refused
    given = spec_values(args, "distill")
    recipe = _recipe(args)
    sequences = given["distill.train.sequences"] or recipe.steps * recipe.batch_size
    train = CalibrationSpec(source=given["distill.train.source"], sequences=sequences,
                            seq_len=given["distill.train.seq_len"], text_field=given["distill.train.text_field"],
                            skip_blocks=given["distill.train.skip_blocks"])
    evaluation = CalibrationSpec(source=given["distill.eval.source"], sequences=given["distill.eval.sequences"],
                                 seq_len=given["distill.eval.seq_len"] or train.seq_len,
                                 text_field=given["distill.eval.text_field"])
    calibration, identity = calibration_of(args)
    return DistillSpec(layouts=tuple(given["distill.layouts"]), train=train, eval=evaluation,
                       devices=given["devices"], delta=given["delta"], seeds=tuple(given["distill.seeds"]),
                       recipe=recipe, reference=args.reference, candidate=args.candidate, calibration=calibration,
                       calibration_identity=identity, allow_overlap=given["distill.allow_overlap"],
                       world_size=given["distill.world_size"], schedule=schedule)


class _Bars:
    """One tqdm bar per run on stderr: step, loss, last evaluation's KL, and tqdm's ETA."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.bar: Any = None

    def start(self, layout: str, seed: int) -> None:
        from tqdm import tqdm

        self.close()
        self.bar = tqdm(total=self.steps, desc=f"{layout} seed {seed}", unit="step", file=sys.stderr,
                        dynamic_ncols=True, disable=None)

    def step(self, layout: str, seed: int, stats: Any, last: Any) -> None:
        if self.bar is None:
            return
        done = stats.step + 1
        if self.bar.n == 0 and done > 1:  # a resumed run: the rate and ETA count only the steps run now
            self.bar.initial = self.bar.n = self.bar.last_print_n = done - 1
        postfix = {"loss": f"{stats.loss:.4f}", "lr": f"{stats.lr:.2e}"}
        if last is not None:
            postfix["eval KL"] = f"{last.kl:.4f}@{last.step}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def cmd_distill(args: argparse.Namespace) -> int:
    from models import distill
    from models.distill.sharding import launch_rank
    from models.families import model_shape
    from models.io.loading import ModelSource
    from models.run import stages
    from models.run.plan import plan_distill
    from models.run.runner import run_stages

    spec = _spec(args)
    source = ModelSource(args.model, revision=args.revision, gguf_file=args.gguf_file)
    config = model_config(args, source)
    check_layout_numbers(config, spec.devices, spec.delta, spec.schedule)  # fail before loading weights
    layouts_dir = layouts_dir_of(args)
    distill.resolve_layouts(spec.layouts, shape=model_shape(config), devices=spec.devices, delta=spec.delta,
                            layouts_dir=layouts_dir)  # name errors before the weights load
    out = Path(args.out)
    if args.overwrite:
        distill.remove_runs(out)
    t0 = time.perf_counter()
    bars = _Bars(spec.recipe.steps)

    def on_eval(record: Any) -> None:
        if bars.bar is not None:
            bars.bar.write(f"{record.layout} seed {record.seed} step {record.step}: KL {record.kl:.4f} "
                           f"ppl {record.ppl:.3f}", file=sys.stderr)

    plan = plan_distill(spec, model_id=args.model, dtype=args.dtype)
    ctx = stages.RunContext.of(plan, run_dir=out, source=lambda: source, device=args.device,
                               converted=converted_cache(args),
                               distill_output=stages.DistillOutput(out_dir=out, layouts_dir=layouts_dir,
                                                                   keep_checkpoints=not args.no_checkpoints_kept,
                                                                   on_eval=on_eval, on_step=bars.step,
                                                                   on_run_start=bars.start))
    try:
        run_stages(stages.STAGES, ctx, CliHooks("distill", model=args.model))
    finally:
        bars.close()
    summary = ctx.distill_summary
    assert summary is not None
    if launch_rank() != 0:  # another rank of a torchrun launch: rank 0 reports
        return 0
    print(distill.summary_table(summary))
    from models.data.heldout import describe_dict

    for line in describe_dict(summary.get("data") or {}):
        print(f"data: {line}")
    print(f"wrote {out}/metrics.csv, {out}/summary.json, {out}/curves.png and runs/ "
          f"({time.perf_counter() - t0:.0f}s)")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("distill", help="distil DTP models of several layouts from the dense one; compare curves",
                       description="Distil the DTP model of each layout from the frozen dense model with one recipe "
                                   "(the paper's by default) and compare KL/perplexity curves. Rerunning with the "
                                   "same --out resumes from the last checkpoints.")
    p.add_argument("--from", dest="from_dir", help="a `dtp-layout optimise` output directory (reads DIR/layouts/)")
    data = p.add_argument_group("data")
    recipe = p.add_argument_group("recipe (defaults: the paper's)")
    # the job spec's flags of `distill` (models/run/jobspec.py): the model, L, δ, the layouts and seeds, the
    # training and evaluation data, and the recipe
    add_model_args(p, "distill", groups={"distill.train": data, "distill.eval": data, "distill.recipe": recipe})
    p.add_argument("--reference", default="contiguous", help="headline baseline layout (default: contiguous)")
    p.add_argument("--candidate", default="optimised", help="headline layout (default: optimised)")
    p.add_argument("--no-checkpoints-kept", action="store_true",
                   help="delete each run's checkpoint once the run is complete")
    p.add_argument("--out", required=True, help="output directory (metrics.csv, summary.json, curves.png, runs/)")
    p.add_argument("--overwrite", action="store_true", help="discard earlier runs in --out instead of resuming")
    p.set_defaults(func=cmd_distill)
    schedule_flags(p)
    needs_worker_extra(p)
