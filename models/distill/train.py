"""One optimiser step: micro-batches with gradient accumulation, clipping, AdamW at the scheduled lr."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from models.base.progress import Cancelled, ShouldStop
from models.distill.loss import LossSums, loss_and_backward
from models.distill.recipe import DistillRecipe
from models.distill.schedule import learning_rate
from models.distill.sharding import Ranks, total_norm
from models.distill.student import trainable_parameters
from models.sim.dtp import DTPModel


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
               step: int, recipe: DistillRecipe, should_stop: ShouldStop | None = None,
               ranks: Ranks | None = None) -> StepStats:
    """One optimiser step on the global batch [batch_size, S] through micro-batches and gradient accumulation.

    A micro-batch is micro_batch_size sequences within MAX_FORWARD_TOKENS (`recipe.train_rows`): the
    gradient is the same however the batch is cut. With W ranks (`models.distill.sharding`), each
    rank forwards its B/W rows and normalises by its share of the tokens (B·S / W), so the gradients
    averaged over ranks (FSDP2's reduce-scatter) are the W = 1 ones. Raises `Cancelled`
    between micro-batches when should_stop() is true (the optimiser has not stepped: the step is
    simply not taken); with W > 1 the stop is agreed at step boundaries only (`_Run`)."""
    ranks = ranks or Ranks.single()
    student.train()
    lr = learning_rate(step, recipe)
    for group in optimizer.param_groups:
        group["lr"] = lr
    b, s = batch.shape
    kl_norm, ce_norm = b * s, b * (s - 1)
    sums = LossSums()
    rows = recipe.train_rows(s)
    local = ranks.local_rows(batch)  # [B/W, S]
    for start in range(0, local.shape[0], rows):
        if start and not ranks.sharded and should_stop is not None and should_stop():
            optimizer.zero_grad(set_to_none=True)
            raise Cancelled(f"training step {step} cancelled at sequence {start} of {b}")
        micro = local[start : start + rows]
        sums.add(loss_and_backward(student, teacher, micro, recipe=recipe, kl_norm=kl_norm // ranks.world_size,
                                   ce_norm=ce_norm // ranks.world_size))
    params = [p for group in optimizer.param_groups for p in group["params"]]
    max_norm = recipe.grad_clip if recipe.grad_clip > 0 else math.inf
    norm = total_norm([p.grad for p in params if p.grad is not None])
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    kl_sum, ce_sum = ranks.sum([sums.kl, sums.ce])
    kl, ce = kl_sum / kl_norm, ce_sum / ce_norm
    return StepStats(step=step, loss=kl + recipe.ce_weight * ce, kl=kl, ce=ce, grad_norm=float(norm), lr=lr)
