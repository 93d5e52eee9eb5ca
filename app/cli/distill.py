"""`dtp-layout distill`: distil DTP models of several layouts from the dense one and compare the curves.

Registered by `app.cli.main` (see `_EXTENSIONS`). Imports nothing heavy at import time: only the torch-free
recipe (whose defaults are the flags' defaults); torch and the rest of models.* load inside the command.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from app.cli.extras import needs_worker_extra
from app.cli.main import CliError, _add_model_args, _calibration_of, _check_layout_numbers, _layouts_dir
from app.cli.run import CliHooks
from models.distill.recipe import EVAL_SEQUENCES, SEQ_LEN, WIKITEXT2_TEST, DistillRecipe  # torch-free
from models.layouts.format import LAYOUT_FORMAT

PAPER = DistillRecipe()  # the defaults of every recipe flag


def _csv_list(text: str, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise CliError(f"{what}: give a comma-separated list, got {text!r}")
    return items


def _seeds(text: str) -> list[int]:
    try:
        return [int(x) for x in _csv_list(text, "--seeds")]
    except ValueError as exc:
        raise CliError(f"--seeds must be comma-separated integers, got {text!r}") from exc


def _recipe(args: argparse.Namespace) -> DistillRecipe:
    return DistillRecipe(
        steps=args.steps, batch_size=args.batch_size, micro_batch_size=args.micro_batch_size, lr=args.lr,
        min_lr=args.min_lr, warmup_steps=args.warmup, betas=(args.beta1, args.beta2), weight_decay=args.weight_decay,
        grad_clip=args.grad_clip, ce_weight=args.ce_weight, freeze_embeddings=not args.train_embeddings,
        freeze_lm_head=args.freeze_lm_head, autocast=args.autocast, gradient_checkpointing=args.gradient_checkpointing,
        logit_chunk=args.logit_chunk, eval_every=args.eval_every, eval_batch_size=args.eval_batch_size,
        checkpoint_every=args.checkpoint_every, last_scale=args.last_scale)


def _spec(args: argparse.Namespace) -> Any:
    from models.calibration import CalibrationSpec
    from models.distill import DistillSpec

    recipe = _recipe(args)
    sequences = args.train_sequences or recipe.steps * recipe.batch_size
    train = CalibrationSpec(source=args.data, sequences=sequences, seq_len=args.seq_len, text_field=args.text_field,
                            skip_blocks=args.train_skip_blocks)
    evaluation = CalibrationSpec(source=args.eval_data, sequences=args.eval_blocks,
                                 seq_len=args.eval_seq_len or args.seq_len, text_field=args.text_field)
    calibration, identity = _calibration_of(args)
    return DistillSpec(layouts=tuple(_csv_list(args.layouts, "--layouts")), train=train, eval=evaluation,
                       devices=args.devices, delta=args.delta, seeds=tuple(_seeds(args.seeds)), recipe=recipe,
                       reference=args.reference, candidate=args.candidate, calibration=calibration,
                       calibration_identity=identity, allow_overlap=args.allow_overlap)


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
    from models import distill, stages
    from models.families import model_shape
    from models.loading import ModelSource, load_config
    from models.runner import run_stages

    spec = _spec(args)
    source = ModelSource(args.model, revision=args.revision, gguf_file=args.gguf_file)
    config = load_config(source)
    _check_layout_numbers(config, spec.devices, spec.delta)  # fail before loading weights
    layouts_dir = _layouts_dir(args)
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

    # The stages of models.stages that apply without an optimise spec: loading, then distilling (which
    # resumes every run from its checkpoints in --out by itself).
    ctx = stages.RunContext(run_dir=out, model_id=args.model, source=lambda: source, dtype=args.dtype,
                            device=args.device, devices=spec.devices, delta=spec.delta,
                            distill=stages.DistillPlan(spec=spec, out_dir=out, layouts_dir=layouts_dir,
                                                       keep_checkpoints=not args.no_checkpoints_kept,
                                                       on_eval=on_eval, on_step=bars.step, on_run_start=bars.start))
    try:
        run_stages(stages.STAGES, ctx, CliHooks("distill", model=args.model))
    finally:
        bars.close()
    summary = ctx.distill_summary
    assert summary is not None
    print(distill.summary_table(summary))
    from models.heldout import describe_dict

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
    _add_model_args(p)
    p.add_argument("--layouts", default="optimised,contiguous",
                   help="comma-separated: names from --from DIR/layouts (optimised, anti-optimised, heads-only, …), "
                        f"contiguous, random-SEED / random:SEED, or {LAYOUT_FORMAT} JSON paths "
                        "(default: optimised,contiguous)")
    p.add_argument("--from", dest="from_dir", help="a `dtp-layout optimise` output directory (reads DIR/layouts/)")
    p.add_argument("--seeds", default="0", help="comma-separated training seeds; each (layout, seed) is a run")
    p.add_argument("--devices", "-L", type=int, required=True, help="number of DTP devices L")
    p.add_argument("--delta", "-d", type=int, default=1, help="delay δ in modules (default: 1)")
    p.add_argument("--last-scale", default=PAPER.last_scale, choices=DistillRecipe.rules()["last_scale"].choices)
    data = p.add_argument_group("data")
    data.add_argument("--data", required=True,
                      help="training data spec: text file, directory of .txt, .jsonl, .npy of ids, corpus:NAME, "
                           "hf:OWNER/NAME[:CONFIG[:SPLIT]]")
    data.add_argument("--train-sequences", type=int, default=None,
                      help="training blocks to load (default: steps × batch size, one pass); fewer repeat in "
                           "seeded epochs")
    data.add_argument("--train-skip-blocks", type=int, default=0, help="skip this many blocks at the source's start")
    data.add_argument("--seq-len", type=int, default=SEQ_LEN, help=f"tokens per training block (default: {SEQ_LEN})")
    data.add_argument("--eval-data", default=WIKITEXT2_TEST,
                      help=f"held-out evaluation data spec (default: {WIKITEXT2_TEST}, needs `datasets` and the "
                           "internet); skips past the training and calibration text when it is the same text")
    data.add_argument("--eval-blocks", type=int, default=EVAL_SEQUENCES,
                      help=f"evaluation blocks (default: {EVAL_SEQUENCES})")
    data.add_argument("--eval-seq-len", type=int, default=None, help="tokens per evaluation block (default: --seq-len)")
    data.add_argument("--text-field", default="text", help="field of .jsonl / hf rows holding the text")
    data.add_argument("--allow-overlap", action="store_true",
                      help="read the specs as given even where training overlaps the --from run's calibration "
                           "blocks or evaluation overlaps either (reported in summary.json); by default, on the "
                           "same text (by content), training starts after the calibration blocks and evaluation "
                           "after both")
    recipe = p.add_argument_group("recipe (defaults: the paper's)")
    recipe.add_argument("--steps", type=int, default=PAPER.steps)
    recipe.add_argument("--batch-size", type=int, default=PAPER.batch_size, help="sequences per optimiser step")
    recipe.add_argument("--micro-batch-size", type=int, default=PAPER.micro_batch_size,
                        help="sequences per forward/backward")
    recipe.add_argument("--lr", type=float, default=PAPER.lr)
    recipe.add_argument("--min-lr", type=float, default=PAPER.min_lr, help="end of the cosine decay")
    recipe.add_argument("--warmup", type=int, default=PAPER.warmup_steps, help="linear warm-up steps")
    recipe.add_argument("--beta1", type=float, default=PAPER.betas[0])
    recipe.add_argument("--beta2", type=float, default=PAPER.betas[1])
    recipe.add_argument("--weight-decay", type=float, default=PAPER.weight_decay)
    recipe.add_argument("--grad-clip", type=float, default=PAPER.grad_clip, help="max gradient norm (0: off)")
    recipe.add_argument("--ce-weight", type=float, default=PAPER.ce_weight, help="loss = KL + w·CE")
    recipe.add_argument("--train-embeddings", action="store_true", help="do not freeze the input embeddings")
    recipe.add_argument("--freeze-lm-head", action="store_true", help="also freeze an untied LM head")
    recipe.add_argument("--autocast", default=PAPER.autocast, choices=DistillRecipe.rules()["autocast"].choices,
                        help="auto: bf16 autocast on CUDA, fp32 on CPU")
    recipe.add_argument("--gradient-checkpointing", action="store_true")
    recipe.add_argument("--logit-chunk", type=int, default=PAPER.logit_chunk,
                        help="tokens per chunk of the loss over the vocabulary")
    recipe.add_argument("--eval-every", type=int, default=PAPER.eval_every)
    recipe.add_argument("--eval-batch-size", type=int, default=PAPER.eval_batch_size)
    recipe.add_argument("--checkpoint-every", type=int, default=PAPER.checkpoint_every,
                        help="evaluations between checkpoints")
    p.add_argument("--reference", default="contiguous", help="headline baseline layout (default: contiguous)")
    p.add_argument("--candidate", default="optimised", help="headline layout (default: optimised)")
    p.add_argument("--no-checkpoints-kept", action="store_true",
                   help="delete each run's checkpoint once the run is complete")
    p.add_argument("--out", required=True, help="output directory (metrics.csv, summary.json, curves.png, runs/)")
    p.add_argument("--overwrite", action="store_true", help="discard earlier runs in --out instead of resuming")
    p.set_defaults(func=cmd_distill)
    needs_worker_extra(p)
