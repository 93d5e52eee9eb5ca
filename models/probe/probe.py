"""The probe itself: every candidate distilled S steps on the calibration text by `models.distill.run.distill_run`
(the one training loop, its student, evaluation and resume), the lowest held-out KL winning.

Data: the probe trains on the calibration blocks themselves (the text the layouts were optimised on) and
measures KL(dense ‖ DTP) on `eval_sequences` blocks of the same text placed after them
(`models.data.heldout.place`: disjoint from every block it trains on; probe.json's `data` says where).

Cost: before any candidate trains, one optimiser step of the first candidate is timed (and thrown away);
the probe's whole work in token passes (`models.distill.run.RunWork`) at that rate is its estimated time.
The cost (tokens, the measured step, the estimate, the budget) is written to cost.json and told to
`announce` first, and a probe whose estimate is over its `max_seconds` is refused (ProbeError naming
probe_max_seconds) before it trains.

out_dir: candidates/*.json (the candidate layouts), cost.json, runs/NAME/ (each candidate's run, `distill_run`'s
files), metrics.csv (every evaluation), probe.json (PROBE_FORMAT: the pick, each candidate's curve, the cost).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.base.progress import Progress, ShouldStop
from models.data.calibration import CalibrationSpec, load_blocks
from models.data.heldout import Placement, place
from models.distill.comparison.report import headline, mean_curves
from models.distill.data import batch_indices
from models.distill.evaluation import DenseReference
from models.distill.recipe import DistillRecipe
from models.distill.records import EvalRecord, write_metrics
from models.distill.run import RunWork, distill_run, reference_work
from models.distill.student import make_student
from models.distill.train import make_optimizer, train_step
from models.io.atomic import atomic_write_json
from models.layouts.layout import Layout
from models.probe.candidates import OPTIMISED
from models.probe.spec import ProbeCost, ProbeError, ProbeSpec
from models.schedules.grammar import ScheduleSpec

PROBE_FORMAT = "dtp-layout-probe/1"
STAGE = "probing"
CANDIDATES_DIR, COST_FILE, PROBE_FILE, RUNS_DIR = "candidates", "cost.json", "probe.json", "runs"


def probe_data(calibration: CalibrationSpec, eval_sequences: int) -> Placement:
    """Where the probe reads: the calibration blocks as the affinity pass read them (block order aside), and
    `eval_sequences` blocks of the same text that `models.data.heldout.place` moves after them."""
    held_out = CalibrationSpec(source=calibration.source, sequences=eval_sequences, seq_len=calibration.seq_len,
                               text_field=calibration.text_field, skip_blocks=calibration.skip_blocks)
    return place(replace(calibration, seed=0), held_out)


def measure_step(teacher: nn.Module, layout: Layout, recipe: DistillRecipe, train_blocks: torch.Tensor,
                 schedule: ScheduleSpec | None) -> float:
    """Wall seconds of one optimiser step of `layout`'s student (built, stepped once and thrown away)."""
    device = next(teacher.parameters()).device
    student = make_student(teacher, layout, recipe, schedule).to(device)
    optimizer = make_optimizer(student, recipe)
    index = batch_indices(0, batch_size=recipe.batch_size, num_blocks=len(train_blocks), seed=0)
    batch = train_blocks[torch.from_numpy(index)].to(device)  # [B, S]
    t0 = time.perf_counter()
    train_step(student, teacher, batch, optimizer, step=0, recipe=recipe)
    return time.perf_counter() - t0


def estimate_seconds(cost: ProbeCost, recipe: DistillRecipe, step_seconds: float) -> float:
    """The probe's time at the measured step's rate: every candidate's steps and evaluations and the dense
    model's reference, in token passes (`RunWork`: a step is 4 passes of its tokens, an evaluation 2)."""
    eval_tokens = cost.eval_sequences * cost.seq_len
    run = RunWork.of(recipe, cost.seq_len, eval_tokens)
    per_pass = step_seconds / run.step
    return (cost.candidates * run.total + reference_work(eval_tokens)) * per_pass


def budget_check(cost: ProbeCost, estimate: float, probe: ProbeSpec, step_seconds: float) -> None:
    """ProbeError naming probe_max_seconds when the estimate is over the budget."""
    if estimate > probe.max_seconds:
        raise ProbeError("probe_max_seconds",
                         f"the probe would take about {estimate:,.0f} s ({cost.describe()}; one step measured at "
                         f"{step_seconds:.2f} s), over probe_max_seconds={probe.max_seconds:g}: raise "
                         f"probe_max_seconds, or lower probe (candidates), probe_steps or probe_eval_sequences")


def run_probe(probe: ProbeSpec, *, teacher: nn.Module, tokenizer: Any, candidates: dict[str, Layout],
              calibration: CalibrationSpec, schedule: ScheduleSpec | None, out_dir: Path, model_id: str = "",
              progress: Progress | None = None, should_stop: ShouldStop | None = None,
              announce: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Distil every candidate S steps (`models.distill.run.distill_run`, one seed), pick the lowest held-out KL;
    returns (and writes) probe.json's content. `schedule`: what the students simulate, as a run takes it
    (a parsed ScheduleSpec; None: the layouts' dtp:δ).

    Rerun over the same out_dir, finished candidates are read back (distill_run's resume). Raises ProbeError
    (probe_max_seconds) before training when the estimated time is over the budget."""
    t0 = time.perf_counter()
    probe.check_calibration(calibration.sequences)
    out_dir = Path(out_dir)
    for name, lay in candidates.items():
        lay.save(out_dir / CANDIDATES_DIR / f"{name}.json")
    names, recipe = list(candidates), probe.recipe()
    placement = probe_data(calibration, probe.eval_sequences)
    assert placement.train is not None
    config: Any = teacher.config
    train_blocks = load_blocks(placement.train, tokenizer, vocab_size=int(config.vocab_size))  # [n, S]
    eval_blocks = load_blocks(placement.eval, tokenizer, vocab_size=int(config.vocab_size))  # [N, S]
    cost = probe.cost(int(train_blocks.shape[1]))
    step_seconds = measure_step(teacher, candidates[names[0]], recipe, train_blocks, schedule)
    estimate = estimate_seconds(cost, recipe, step_seconds)
    said = {**cost.as_dict(), "measured_step_seconds": step_seconds, "estimated_seconds": estimate,
            "max_seconds": probe.max_seconds}
    atomic_write_json(out_dir / COST_FILE, said)
    if announce is not None:
        announce(f"{cost.describe()}; one step measured at {step_seconds:.2f} s: about {estimate:,.0f} s "
                 f"(budget probe_max_seconds={probe.max_seconds:g})")
    budget_check(cost, estimate, probe, step_seconds)
    # progress in token passes, as `run_distill` counts it: the dense reference, then each candidate's run
    run_work = RunWork.of(recipe, int(train_blocks.shape[1]), eval_blocks.numel()).total
    before = reference_work(eval_blocks.numel())
    total = before + len(names) * run_work

    def tell(done: float) -> None:
        if progress is not None:
            progress(STAGE, min(1.0, done / total))

    reference = DenseReference.compute(teacher, eval_blocks, recipe=recipe, should_stop=should_stop,
                                       done=lambda f: tell(f * before))
    records: list[EvalRecord] = []
    for index, name in enumerate(names):
        def run_progress(_stage: str, fraction: float, index: int = index) -> None:
            tell(before + (index + fraction) * run_work)

        result = distill_run(teacher=teacher, layout=candidates[name], seed=probe.seed, recipe=recipe,
                             train_blocks=train_blocks, reference=reference, run_dir=out_dir / RUNS_DIR / name,
                             model_id=model_id, progress=run_progress, should_stop=should_stop,
                             keep_checkpoint=False, schedule=schedule)
        records += result.records
        write_metrics(out_dir, records)
    record = probe_record(mean_curves(records), candidates, recipe=recipe, placement=placement,
                          dense_ppl=reference.dense_ppl, cost=said, seconds=time.perf_counter() - t0)
    atomic_write_json(out_dir / PROBE_FILE, record)
    return record


def pick(finals: dict[str, float]) -> str:
    """The candidate with the lowest final held-out KL; a tie goes to the earlier candidate."""
    return min(finals, key=lambda name: (finals[name], list(finals).index(name)))


def probe_record(curves: dict[str, dict[str, Any]], candidates: dict[str, Layout], *, recipe: DistillRecipe,
                 placement: Placement, dense_ppl: float, cost: dict[str, Any], seconds: float) -> dict[str, Any]:
    """probe.json: the pick, each candidate's held-out curve (steps, KL, perplexity), J_σ and how it was built."""
    finals = {name: float(curves[name]["kl"][-1]) for name in candidates}
    chosen = pick(finals)
    rows = {name: {"steps": curves[name]["steps"], "kl": curves[name]["kl"], "ppl": curves[name]["ppl"],
                   "final_kl": finals[name], "J": (lay.score or {}).get("J"),
                   "candidate": (lay.score or {}).get("candidate")} for name, lay in candidates.items()}
    versus = headline(curves, reference=OPTIMISED, candidate=chosen) if chosen != OPTIMISED else None
    assert placement.train is not None
    return {"format": PROBE_FORMAT, "chosen": chosen, "chosen_final_kl": finals[chosen],
            "jsigma_choice": OPTIMISED if OPTIMISED in candidates else None, "candidates": rows,
            "recipe": recipe.as_dict(), "train": asdict(placement.train), "eval": asdict(placement.eval),
            "data": placement.as_dict(), "dense_ppl": dense_ppl, "cost": cost,
            "versus_jsigma": None if versus is None else versus["said"], "seconds": round(seconds, 1)}


def read_probe(out_dir: Path) -> dict[str, Any]:
    return dict(json.loads((Path(out_dir) / PROBE_FILE).read_text()))


def chosen_layout(out_dir: Path, record: dict[str, Any]) -> Layout:
    """The probe's pick, as its candidate file holds it."""
    from models.layouts.layout import load

    return load(Path(out_dir) / CANDIDATES_DIR / f"{record['chosen']}.json")
