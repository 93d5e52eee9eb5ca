"""One (layout, seed) run over its directory: the training loop, its evaluations, checkpoints and resume.

The run evaluates at step 0, every `eval_every` steps and at the last; it checkpoints every
`checkpoint_every` evaluations and at the end. Started over an existing directory with the same
fingerprint, it resumes from the checkpoint (or returns a finished run's records); the block order
is a pure function of (seed, step), so a resumed run follows the uninterrupted curve.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from models.base.progress import Cancelled, Progress, ShouldStop
from models.distill.checkpoint import (
    CHECKPOINT_DIR,
    checkpoint_to_read,
    read_run_state,
    remove_checkpoint,
    restore,
    run_fingerprint,
    save_checkpoint,
)
from models.distill.data import batch_indices
from models.distill.evaluation import DenseReference, evaluate_student
from models.distill.recipe import DistillError, DistillRecipe
from models.distill.records import EvalRecord, RunState, read_complete, write_logs
from models.distill.schedule import learning_rate
from models.distill.sharding import (
    BACKEND_TIMEOUT,
    Ranks,
    backend_for,
    die_with_parent,
    init_from_env,
    rank_device,
    run_children,
    shard_student,
    shard_teacher,
    torchrun_world,
)
from models.distill.student import make_student
from models.distill.train import StepStats, make_optimizer, train_step
from models.layouts.layout import Layout
from models.schedules.grammar import ScheduleSpec

STAGE = "distilling"


@dataclass
class RunResult:
    layout: str
    seed: int
    records: list[EvalRecord]
    steps: list[StepStats]
    run_dir: Path
    resumed_from: int | None  # the checkpoint step this call started from, if any
    seconds: float

    @property
    def final(self) -> EvalRecord:
        return self.records[-1]


@dataclass(frozen=True)
class RunHooks:
    """A run's callbacks (all optional); see `distill_run`."""

    progress: Progress | None = None
    should_stop: ShouldStop | None = None
    on_eval: Callable[[EvalRecord], None] | None = None
    on_step: Callable[[StepStats, EvalRecord | None], None] | None = None
    on_restore: Callable[[list[EvalRecord]], None] | None = None
    # the student as it was just evaluated (a further evaluation set of a study; world size 1 only)
    on_eval_student: Callable[[EvalRecord, nn.Module], None] | None = None


def eval_steps(recipe: DistillRecipe) -> list[int]:
    """The steps after which a run evaluates: 0, every eval_every, and the last."""
    return recipe.eval_steps()


# Progress counts the work a run does, not its optimiser steps alone: the evaluations (step 0's, before any
# step) and the dense reference take as long as many steps, and a bar held at 0 % through them made the ETA
# (elapsed · (1 − f) / f) wild. The unit is one token through one model one way, a backward counted as two
# forwards: a step runs the teacher forward and the student forward and backward over its training blocks
# (4 passes), an evaluation the teacher and the student forward over the evaluation blocks (2), the dense
# reference the teacher over them once (1).
STEP_PASSES, EVAL_PASSES, REFERENCE_PASSES = 4, 2, 1


@dataclass(frozen=True)
class RunWork:
    """One (layout, seed) run's work in token passes: its steps and its evaluations."""

    steps: int
    step: float  # one optimiser step's passes
    evaluations: int
    evaluation: float  # one evaluation's passes

    @classmethod
    def of(cls, recipe: DistillRecipe, train_seq_len: int, eval_tokens: int) -> RunWork:
        """eval_tokens: the evaluation blocks' n × S."""
        return cls(steps=recipe.steps, step=float(STEP_PASSES * recipe.batch_size * train_seq_len),
                   evaluations=len(eval_steps(recipe)), evaluation=float(EVAL_PASSES * eval_tokens))

    @property
    def total(self) -> float:
        return self.steps * self.step + self.evaluations * self.evaluation

    def fraction(self, steps: int, evaluations: float) -> float:
        """The share of the run done after `steps` steps and `evaluations` evaluations (a fraction of one
        for the one under way)."""
        done = min(steps, self.steps) * self.step + min(evaluations, self.evaluations) * self.evaluation
        return done / self.total if self.total else 1.0


def reference_work(eval_tokens: int) -> float:
    """The dense reference's passes: the teacher once over the evaluation blocks' n × S tokens."""
    return float(REFERENCE_PASSES * eval_tokens)


def _mean_loss_since(state: RunState, previous_eval: int) -> float | None:
    losses = [s.loss for s in state.steps if s.step >= previous_eval]
    return sum(losses) / len(losses) if losses else None


class _Run:
    """One (layout, seed) run over its directory: the training loop, its evaluations and checkpoints."""

    def __init__(self, *, teacher: nn.Module, layout: Layout, seed: int, recipe: DistillRecipe,
                 train_blocks: torch.Tensor, reference: DenseReference, run_dir: Path, fingerprint: str,
                 hooks: RunHooks, keep_checkpoint: bool, ranks: Ranks, schedule: ScheduleSpec | None = None,
                 own_teacher: bool = False) -> None:
        self.teacher, self.layout, self.seed, self.recipe = teacher, layout, seed, recipe
        self.schedule = schedule  # None: the layout's dtp:δ
        self.train_blocks, self.reference, self.run_dir = train_blocks, reference, run_dir
        self.fingerprint, self.hooks, self.keep_checkpoint = fingerprint, hooks, keep_checkpoint
        self.ranks = ranks
        self.device = next(teacher.parameters()).device
        self.student = make_student(teacher, layout, recipe, schedule).to(self.device)
        if ranks.sharded:
            shard_student(self.student, self.device)
            # The caller's teacher stays whole (run_distill builds the next run's student from it), so
            # the launching process shards a copy; a spawned rank owns its teacher and shards it in place.
            self.teacher = shard_teacher(teacher if own_teacher else copy.deepcopy(teacher), self.device)
        self.optimizer = make_optimizer(self.student, recipe)
        self.ckpt_path = run_dir / CHECKPOINT_DIR
        self.state = RunState()
        self.evals = eval_steps(recipe)
        self.work = RunWork.of(recipe, train_blocks.shape[1], reference.blocks.numel())
        self.clock_start = time.perf_counter()

    def restore(self) -> int | None:
        """Load the checkpoint if there is one; the step it was taken at."""
        found = checkpoint_to_read(self.ckpt_path)
        if found is None:
            return None
        data = read_run_state(found)
        if data["fingerprint"] != self.fingerprint:
            raise DistillError(f"{self.ckpt_path} was made by a different configuration (layout, seed, recipe or "
                               "data); use another output directory or remove it (--overwrite)")
        self.state = restore(found, data, self.student, self.optimizer)
        self.clock_start = time.perf_counter() - self.state.elapsed  # elapsed_s counts across resumes
        if self.hooks.on_restore:
            self.hooks.on_restore(list(self.state.records))
        return self.state.step

    def due_for_eval(self) -> bool:
        state = self.state
        return state.step in self.evals and (not state.records or state.records[-1].step < state.step)

    def evaluate(self) -> EvalRecord:
        state, recipe = self.state, self.recipe
        kl, ppl = evaluate_student(self.student, self.teacher, self.reference, recipe=recipe,
                                   should_stop=None if self.ranks.sharded else self.hooks.should_stop,
                                   done=self.report)
        previous = max((e for e in self.evals if e < state.step), default=0)
        state.elapsed = time.perf_counter() - self.clock_start
        return EvalRecord(layout=self.layout.name, seed=self.seed, step=state.step, kl=kl, ppl=ppl,
                          loss=_mean_loss_since(state, previous),
                          lr=state.steps[-1].lr if state.steps else learning_rate(0, recipe),
                          tokens=state.step * recipe.batch_size * self.train_blocks.shape[1],
                          elapsed_s=state.elapsed)

    def write_logs(self, complete: bool) -> None:
        if not self.ranks.writer:
            return
        write_logs(self.run_dir, layout=self.layout, seed=self.seed, fingerprint=self.fingerprint,
                    recipe=self.recipe, state=self.state, complete=complete, dense_ppl=self.reference.dense_ppl,
                   schedule=self.schedule)

    def save(self, complete: bool) -> None:
        if not complete or self.keep_checkpoint:
            save_checkpoint(self.ckpt_path, student=self.student, optimizer=self.optimizer, state=self.state,
                            fingerprint=self.fingerprint, seed=self.seed, recipe=self.recipe, ranks=self.ranks)
        self.write_logs(complete)
        if complete and not self.keep_checkpoint and self.ranks.writer:
            remove_checkpoint(self.ckpt_path)  # only once the logs say the run is complete

    def eval_and_log(self) -> None:
        record = self.evaluate()
        self.state.records.append(record)
        finished = self.state.step == self.recipe.steps
        if finished or len(self.state.records) % self.recipe.checkpoint_every == 0:
            self.save(complete=finished)
        else:
            self.write_logs(complete=False)
        if self.hooks.on_eval:
            self.hooks.on_eval(record)
        if self.hooks.on_eval_student:
            self.hooks.on_eval_student(record, self.student)

    def train_one_step(self) -> None:
        state, recipe = self.state, self.recipe
        if self.ranks.any(self.hooks.should_stop is not None and self.hooks.should_stop()):
            raise Cancelled(f"distillation of {self.layout.name} (seed {self.seed}) cancelled at step {state.step}")
        index = batch_indices(state.step, batch_size=recipe.batch_size, num_blocks=len(self.train_blocks),
                              seed=self.seed)
        batch = self.train_blocks[torch.from_numpy(index)].to(self.device)  # [batch_size, S]
        stats = train_step(self.student, self.teacher, batch, self.optimizer, step=state.step, recipe=recipe,
                           should_stop=self.hooks.should_stop, ranks=self.ranks)
        if not math.isfinite(stats.loss):
            raise DistillError(f"{self.layout.name} (seed {self.seed}): loss is {stats.loss} at step {state.step}; "
                               "lower the learning rate or check the data")
        state.steps.append(stats)
        state.step += 1
        if self.hooks.on_step:
            self.hooks.on_step(stats, state.records[-1] if state.records else None)
        self.report()

    def report(self, evaluating: float = 0.0) -> None:
        """The run's share done (RunWork): its steps, its evaluations and `evaluating` of the one under way."""
        if self.hooks.progress:
            self.hooks.progress(STAGE, self.work.fraction(self.state.step, len(self.state.records) + evaluating))

    def run(self) -> None:
        while True:
            if self.due_for_eval():
                self.eval_and_log()
            if self.state.step >= self.recipe.steps:
                return
            self.train_one_step()


def distill_run(*, teacher: nn.Module, layout: Layout, seed: int, recipe: DistillRecipe,
                train_blocks: torch.Tensor, reference: DenseReference, run_dir: Path, model_id: str = "",
                progress: Progress | None = None, should_stop: ShouldStop | None = None,
                on_eval: Callable[[EvalRecord], None] | None = None,
                on_step: Callable[[StepStats, EvalRecord | None], None] | None = None,
                on_restore: Callable[[list[EvalRecord]], None] | None = None,
                keep_checkpoint: bool = True, world_size: int = 1,
                schedule: ScheduleSpec | None = None,
                on_eval_student: Callable[[EvalRecord, nn.Module], None] | None = None) -> RunResult:
    """Distil the DTP model of `layout` from `teacher`, evaluating on `reference`; resume if possible.

    schedule: the communication schedule the student simulates (`models.schedules.grammar`; None: the
    layout's dtp:δ).

    train_blocks: [n, S] token ids; each step reads batch_size of them (see `batch_indices`).
    Raises `Cancelled` between steps, micro-batches and evaluation batches when should_stop() is true
    (the last checkpoint stays).
    on_restore gets the evaluations read back from a finished run or a checkpoint; evaluations past
    the checkpoint are recomputed and passed to on_eval again (same layout, seed and step).
    on_eval_student(record, student) gets the student right after each evaluation, before training goes on
    (a study's further evaluation set, measured on the weights that evaluation saw; world_size 1 only: a
    sharded student is whole on no rank).
    world_size W > 1 trains on W ranks (`models.distill.sharding`): this process is rank 0 (hooks and
    logs) and starts ranks 1 .. W-1, unless torchrun started it or a process group already exists.
    """
    t_start = time.perf_counter()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fingerprint = run_fingerprint(layout=layout, seed=seed, recipe=recipe, train_blocks=train_blocks,
                                  eval_blocks=reference.blocks, model_id=model_id, schedule=schedule)
    done = read_complete(run_dir, fingerprint)
    if done is not None:
        if on_restore:
            on_restore(done)
        if progress:
            progress(STAGE, 1.0)
        return RunResult(layout.name, seed, done, [], run_dir, recipe.steps, 0.0)
    if len(train_blocks) < recipe.batch_size:
        raise DistillError(f"{len(train_blocks)} training blocks, fewer than batch_size={recipe.batch_size}")
    if recipe.batch_size % world_size:
        raise DistillError(f"world_size={world_size} must divide recipe.batch_size={recipe.batch_size} (each rank "
                           "takes an equal share of every batch)")
    if on_eval_student is not None and world_size != 1:
        raise DistillError(f"on_eval_student needs the whole student in one process; world_size={world_size}")
    hooks = RunHooks(progress=progress, should_stop=should_stop, on_eval=on_eval, on_step=on_step,
                     on_restore=on_restore, on_eval_student=on_eval_student)
    payload: dict[str, Any] = {
        "teacher": teacher, "layout": layout, "seed": seed, "recipe": recipe, "train_blocks": train_blocks,
        "reference": reference, "run_dir": run_dir, "fingerprint": fingerprint,
        "keep_checkpoint": keep_checkpoint, "schedule": schedule}
    with rank_group(world_size, payload) as ranks:
        run = _Run(**payload, hooks=hooks, ranks=ranks)
        resumed_from = run.restore()
        run.run()
    return RunResult(layout.name, seed, run.state.records, run.state.steps, run_dir, resumed_from,
                     time.perf_counter() - t_start)


@contextlib.contextmanager
def rank_group(world_size: int, payload: dict[str, Any]) -> Iterator[Ranks]:
    """This process's ranks for a run of `world_size`: W = 1 alone; an existing process group or
    torchrun's; else a new group with ranks 1 .. W-1 spawned here (each runs `_rank_main` on payload)."""
    if world_size == 1:
        yield Ranks.single()
        return
    device = next(payload["teacher"].parameters()).device
    if dist.is_initialized():
        ranks = Ranks.current()
        if ranks.world_size != world_size:
            raise DistillError(f"world_size={world_size}, but this process group has {ranks.world_size} ranks")
        yield ranks
        return
    started = torchrun_world()
    if started is not None:
        if started != world_size:
            raise DistillError(f"world_size={world_size}, but torchrun started {started} ranks (WORLD_SIZE)")
        ranks = init_from_env(device)
        try:
            yield ranks
        finally:
            dist.destroy_process_group()
        return
    children, env = run_children(world_size, _rank_main, payload)
    ok = False
    try:
        ranks = _join(env, device)
        yield ranks
        ok = True
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        failed = _reap(children)
    if ok and failed:
        raise DistillError(f"distillation rank(s) {failed} failed; see their output above")


def _join(env: dict[str, str], device: torch.device) -> Ranks:
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    dev = rank_device(device, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend_for(device), init_method=f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
                            rank=rank, world_size=world_size, timeout=BACKEND_TIMEOUT)
    return Ranks.current()


def _reap(children: list[Any], grace_s: float = 60.0) -> list[int]:
    """Wait for the spawned ranks (killing any still alive after grace_s); the ranks that failed."""
    failed = []
    for rank, proc in enumerate(children, start=1):
        proc.join(grace_s)
        if proc.is_alive():
            proc.kill()
            proc.join()
        if proc.exitcode != 0:
            failed.append(rank)
    return failed


def _rank_main(env: dict[str, str], payload: dict[str, Any]) -> None:
    """A spawned rank > 0: the same run with no hooks and no logs; exits with its rank's outcome."""
    die_with_parent()
    device = rank_device(next(payload["teacher"].parameters()).device, int(env["RANK"]))
    payload = {**payload, "teacher": payload["teacher"].to(device)}
    payload["reference"].blocks = payload["reference"].blocks.to(device)
    ranks = _join(env, device)
    try:
        run = _Run(**payload, hooks=RunHooks(), ranks=ranks, own_teacher=True)
        run.restore()
        run.run()
    except Cancelled:
        pass  # rank 0 agreed to stop too and says so
    finally:
        dist.destroy_process_group()
