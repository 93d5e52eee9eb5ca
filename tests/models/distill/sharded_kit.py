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


def compare_main(data: str, out_dir: str, calls: str) -> None:
    """`run_distill` at W = 2 as one torchrun rank (RANK, WORLD_SIZE, MASTER_* set by the caller), on a
    tied-embeddings model; what its callbacks saw goes to `calls` (JSON), written here, not by the run."""
    import json

    from models.data.calibration import CalibrationSpec
    from tests.models.distill.kit import recipe as small_recipe

    torch.set_num_threads(1)
    teacher = tiny_model("llama-tied-headdim")  # the LM head is the embedding: one FSDP unit (the root)
    from models.schedules.grammar import dtp_spec

    spec = D.DistillSpec(layouts=("contiguous",), devices=2, schedule=dtp_spec(1), seeds=(0,),
                         recipe=small_recipe(steps=4), world_size=2,
                         train=CalibrationSpec(data, sequences=16, seq_len=16),
                         eval=CalibrationSpec(data, sequences=4, seq_len=16))
    seen = {"progress": 0, "on_eval": 0, "on_step": 0, "on_run_start": 0}

    def count(name: str):
        def hook(*args) -> None:
            seen[name] += 1
        return hook

    summary = D.run_distill(spec, teacher=teacher, tokenizer=None, out_dir=Path(out_dir), model_id="tiny",
                            progress=count("progress"), on_eval=count("on_eval"), on_step=count("on_step"),
                            on_run_start=count("on_run_start"), keep_checkpoints=False)
    Path(calls).write_text(json.dumps({**seen, "kl": summary["layouts"]["contiguous"]["kl"]}))
