"""One optimiser step: micro-batches with gradient accumulation, clipping, AdamW at the scheduled lr."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from models.distill.loss import LossSums, loss_and_backward
from models.distill.recipe import DistillRecipe
from models.distill.schedule import learning_rate
from models.distill.student import trainable_parameters
from models.dtp import DTPModel
from models.progress import Cancelled, ShouldStop


@dataclass(frozen=True)
class StepStats:
    step: int  # 0-based index of the optimiser step that produced these numbers
    loss: float  # KL + ce_weight · CE, per-token means over the step's batch
    kl: float
    ce: float
    grad_norm: float  # before clipping
    lr: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def make_optimizer(student: DTPModel, recipe: DistillRecipe) -> torch.optim.AdamW:
    params = [p for _, p in trainable_parameters(student)]
    return torch.optim.AdamW(params, lr=recipe.lr, betas=recipe.betas, eps=recipe.adam_eps,
                             weight_decay=recipe.weight_decay)


def train_step(student: DTPModel, teacher: nn.Module, batch: torch.Tensor, optimizer: torch.optim.Optimizer, *,
               step: int, recipe: DistillRecipe, should_stop: ShouldStop | None = None) -> StepStats:
    """One optimiser step on batch [batch_size, S] through micro-batches and gradient accumulation.

    A micro-batch is micro_batch_size sequences within MAX_FORWARD_TOKENS (`recipe.train_rows`): the
    gradient is the same however the batch is cut. Raises `Cancelled` between micro-batches when
    should_stop() is true (the optimiser has not stepped: the step is simply not taken)."""
    student.train()
    lr = learning_rate(step, recipe)
    for group in optimizer.param_groups:
        group["lr"] = lr
    b, s = batch.shape
    kl_norm, ce_norm = b * s, b * (s - 1)
    sums = LossSums()
    rows = recipe.train_rows(s)
    for start in range(0, b, rows):
        if start and should_stop is not None and should_stop():
            optimizer.zero_grad(set_to_none=True)
            raise Cancelled(f"training step {step} cancelled at sequence {start} of {b}")
        micro = batch[start : start + rows]
        sums.add(loss_and_backward(student, teacher, micro, recipe=recipe, kl_norm=kl_norm, ce_norm=ce_norm))
    params = [p for group in optimizer.param_groups for p in group["params"]]
    max_norm = recipe.grad_clip if recipe.grad_clip > 0 else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    kl, ce = sums.kl / kl_norm, sums.ce / ce_norm
    return StepStats(step=step, loss=kl + recipe.ce_weight * ce, kl=kl, ce=ce, grad_norm=grad_norm, lr=lr)
