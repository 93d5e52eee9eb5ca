"""A tiny distillation run at any world size, the same in the test process and in a child that is killed.

Model, data and recipe are fixed (seeded), so every call is the same run; `python -c "...main(...)"` runs
it in a child process (`kill_after` SIGKILLs that process, and with it its spawned ranks, after that step).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from models import distill as D
from tests.models.distill.kit import VOCAB, layout_of
from tests.tiny import tiny_model

STEPS = 20
SEQ = 16


def recipe() -> D.DistillRecipe:
    # batch 4 = 2 ranks × 2 rows or 4 ranks × 1 row; an evaluation and a checkpoint every 5 steps
    return D.DistillRecipe(steps=STEPS, batch_size=4, micro_batch_size=2, lr=2e-3, min_lr=2e-4, warmup_steps=3,
                           eval_every=5, checkpoint_every=1, logit_chunk=16, eval_batch_size=2)


def setup() -> tuple[torch.nn.Module, torch.Tensor, D.DenseReference]:
    teacher = tiny_model("llama")  # untied LM head: it trains, so its gradient crosses the ranks too
    g = torch.Generator().manual_seed(5)
    train = torch.randint(0, VOCAB, (24, SEQ), generator=g)  # [n, S]
    reference = D.DenseReference.compute(teacher, train[:4], recipe=recipe())
    return teacher, train, reference


def run(run_dir: Path, world_size: int, *, kill_after: int | None = None) -> D.RunResult:
    teacher, train, reference = setup()

    def die(stats: D.StepStats, last: D.EvalRecord | None) -> None:
        if kill_after is not None and stats.step == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    return D.distill_run(teacher=teacher, layout=layout_of(teacher), seed=1, recipe=recipe(), train_blocks=train,
                         reference=reference, run_dir=run_dir, on_step=die, world_size=world_size)


def main(run_dir: str, world_size: int, kill_after: int | None) -> None:
    torch.set_num_threads(1)
    run(Path(run_dir), world_size, kill_after=kill_after)
