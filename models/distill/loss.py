"""The distillation loss KL(teacher ‖ student) + w·CE over the vocabulary, chunked over tokens.

The loss is computed `logit_chunk` tokens at a time from the final hidden states, and its gradient
with respect to the student's logits is formed by hand per chunk (softmax differences), so neither
model's fp32 logits for the whole batch ever exist and autograd never stores a [T, V] tensor; the
decoder stack is then back-propagated once from the resulting hidden-state gradient.

`kl_ce_chunk` is the one implementation of the per-chunk statistics: training (with the gradient),
the evaluation of a run, and `models.evaluation.evaluate` (dense vs DTP) all use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.distill.recipe import DistillRecipe
from models.distill.student import autocast, lm_head
from models.sim.dtp import DTPModel, gathered

IGNORE = -100  # target of a position with no next token: counted in KL, not in CE


def next_token_targets(ids: torch.Tensor) -> torch.Tensor:
    """ids: [B, S] -> targets [B*S]: the next token, -100 on each sequence's last position."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], dim=1).reshape(-1)


def target_nll(log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Σ −log prob(target) over the tokens that have a target. log_probs: [t, V]; targets: [t]."""
    rows = (targets != IGNORE).nonzero().squeeze(1)
    return -log_probs[rows, targets[rows]].sum()


@dataclass
class LossSums:
    """Sums over tokens (not means): KL(teacher ‖ student), student CE, and their token counts."""

    kl: float = 0.0
    ce: float = 0.0
    kl_tokens: int = 0
    ce_tokens: int = 0

    def add(self, other: LossSums) -> None:
        self.kl += other.kl
        self.ce += other.ce
        self.kl_tokens += other.kl_tokens
        self.ce_tokens += other.ce_tokens


@dataclass(frozen=True)
class ChunkStats:
    kl: float  # Σ KL(teacher ‖ student) over the chunk's tokens
    ce: float  # Σ student −log q(target) over tokens with a target
    teacher_ce: float  # Σ teacher −log p(target) over the same tokens
    grad: torch.Tensor | None  # [t, V] d(kl_scale·KL + ce_scale·CE)/d(student logits), when asked


@torch.no_grad()
def kl_ce_chunk(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor, *,
                grad_scales: tuple[float, float] | None = None) -> ChunkStats:
    """KL, both CEs and optionally the gradient of kl_scale·KL + ce_scale·CE for one chunk of tokens.

    *_logits: [t, V]; targets: [t] with -100 where there is no next token. With q = softmax(student)
    and p = softmax(teacher), per token: KL = Σ_v p·(log p − log q), dKL/ds = q − p and
    dCE/ds = q − onehot(target). Three [t, V] fp32 buffers at most.
    """
    logq = F.log_softmax(student_logits.float(), dim=-1)  # [t, V]
    logp = F.log_softmax(teacher_logits.float(), dim=-1)  # [t, V]
    ce, teacher_ce = target_nll(logq, targets), target_nll(logp, targets)
    p = logp.exp()  # [t, V]
    log_ratio = logp.sub_(logq)  # log p − log q, in place: log p is not needed any more
    kl = torch.dot(p.view(-1), log_ratio.view(-1))
    grad = None
    if grad_scales is not None:
        kl_scale, ce_scale = grad_scales
        has_target = targets != IGNORE  # [t]
        rows = has_target.nonzero().squeeze(1)
        grad = logq.exp_()  # q, in place: log q is not needed any more
        row_scale = kl_scale + ce_scale * has_target.to(grad.dtype)  # [t]
        grad.mul_(row_scale[:, None]).sub_(p, alpha=kl_scale)
        grad[rows, targets[rows]] -= ce_scale
    return ChunkStats(float(kl), float(ce), float(teacher_ce), grad)


@torch.no_grad()
def chunked_kl_nll(hidden_teacher: torch.Tensor, hidden_student: torch.Tensor, head_teacher: nn.Module,
                   head_student: nn.Module, targets: torch.Tensor, chunk: int) -> tuple[float, float, float]:
    """Sums over tokens of (teacher NLL, student NLL, KL(teacher ‖ student)), heads applied `chunk` tokens
    at a time. hidden_*: [T, D]; targets: [T] (-100 = no next token: counted in KL, not in NLL)."""
    nll_teacher = nll_student = kl = 0.0
    for start in range(0, hidden_teacher.shape[0], chunk):
        sl = slice(start, start + chunk)
        stats = kl_ce_chunk(head_student(hidden_student[sl]), head_teacher(hidden_teacher[sl]), targets[sl])
        nll_teacher += stats.teacher_ce
        nll_student += stats.ce
        kl += stats.kl
    return nll_teacher, nll_student, kl


@torch.no_grad()
def chunked_nll(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, chunk: int) -> float:
    """Σ NLL over the tokens with a target, `head` applied `chunk` tokens at a time. hidden: [T, D]."""
    total = 0.0
    for start in range(0, hidden.shape[0], chunk):
        sl = slice(start, start + chunk)
        total += float(target_nll(F.log_softmax(head(hidden[sl]).float(), dim=-1), targets[sl]))
    return total


def loss_and_backward(student: DTPModel, teacher: nn.Module, ids: torch.Tensor, *, recipe: DistillRecipe,
                      kl_norm: int, ce_norm: int) -> LossSums:
    """Forward both models on ids [b, S], accumulate d(loss)/d(params) into the student's .grad.

    loss = Σ KL / kl_norm + ce_weight · Σ CE / ce_norm, so that micro-batches (and ranks) with the
    step's total token counts as norms add up to the step's per-token mean. The student's part runs
    inside its `gathered` method (its embeddings, norm and LM head whole under FSDP2), the teacher's
    inside its own, under no_grad (`models.distill.sharding.shard_teacher`); the backward is one
    autograd pass from the hand-formed gradients (`_HandFormedLoss`).
    """
    device = ids.device
    b, s = ids.shape
    with torch.no_grad(), autocast(recipe, device):
        hidden_t = gathered(teacher, teacher_hidden, teacher, ids).reshape(b * s, -1)  # [T, D]
    sums = LossSums()
    loss: torch.Tensor = gathered(student, _student_loss, student, teacher, ids, hidden_t, recipe,
                                  (kl_norm, ce_norm), sums)
    loss.backward()
    return sums


class _HandFormedLoss(torch.autograd.Function):
    """A scalar whose backward hands out gradients formed by hand: d/d(hidden) and d/d(head weight).

    It ties the hand-formed gradients into one autograd pass, so the LM head's gradient reaches its
    parameter as any other does (FSDP2 reduce-scatters it with the rest)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, head_weight: torch.Tensor, value: torch.Tensor,
                grad_hidden: torch.Tensor, grad_head: torch.Tensor | None) -> torch.Tensor:
        ctx.grads = (grad_hidden, grad_head)
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_head = ctx.grads
        scale = float(grad_out)
        hidden = grad_hidden if scale == 1.0 else grad_hidden * scale
        head = None if grad_head is None else (grad_head if scale == 1.0 else grad_head * scale)
        return hidden, head, None, None, None


def teacher_hidden(teacher: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The teacher's last hidden states [b, S, D] of ids [b, S]; call it through `gathered(teacher, ...)`."""
    teacher_any: Any = teacher
    hidden: torch.Tensor = teacher_any.model(ids).last_hidden_state
    return hidden


def _student_loss(student: DTPModel, teacher: nn.Module, ids: torch.Tensor, hidden_t: torch.Tensor,
                  recipe: DistillRecipe, norms: tuple[int, int], sums: LossSums) -> torch.Tensor:
    """The student's forward and the chunked loss of one micro-batch (run inside `student.gathered`);
    adds the sums to `sums`, returns the loss as a scalar whose backward trains the student."""
    kl_norm, ce_norm = norms
    device = ids.device
    b, s = ids.shape
    with autocast(recipe, device):
        hidden_s = student.hidden_states(ids)  # [b, S, D]
    flat_s = hidden_s.detach().reshape(b * s, -1)  # [T, D]
    targets = next_token_targets(ids)  # [T]
    head_s = lm_head(student.model)
    sums.add(LossSums(kl_tokens=b * s, ce_tokens=int((targets != IGNORE).sum())))
    scales = (1.0 / kl_norm, recipe.ce_weight / ce_norm)
    with torch.no_grad():  # the teacher's LM head whole for the chunks, no graph through either head
        kl, ce, grad_hidden, grad_head = gathered(teacher, _hand_formed_grads, head_s, lm_head(teacher), flat_s,
                                                  hidden_t, targets, recipe, scales)
    sums.kl += kl
    sums.ce += ce
    value = torch.tensor(kl * scales[0] + ce * scales[1], device=device)  # this micro-batch's share of the loss
    loss: torch.Tensor = _HandFormedLoss.apply(hidden_s, head_s.weight, value,
                                               grad_hidden.view(b, s, -1).to(hidden_s.dtype), grad_head)
    return loss


def _hand_formed_grads(head_s: nn.Linear, head_t: nn.Module, flat_s: torch.Tensor, hidden_t: torch.Tensor,
                       targets: torch.Tensor, recipe: DistillRecipe, scales: tuple[float, float],
                       ) -> tuple[float, float, torch.Tensor, torch.Tensor | None]:
    """(Σ KL, Σ CE, d loss/d hidden [T, D], d loss/d head weight [V, D] or None), `recipe.logit_chunk`
    tokens at a time: both heads' logits of a chunk at once, never [T, V]."""
    device = flat_s.device
    train_head = head_s.weight.requires_grad
    grad_hidden = torch.empty_like(flat_s, dtype=torch.float32)  # [T, D]
    grad_head = torch.zeros_like(head_s.weight, dtype=torch.float32) if train_head else None  # [V, D]
    kl = ce = 0.0
    for start in range(0, flat_s.shape[0], recipe.logit_chunk):
        sl = slice(start, start + recipe.logit_chunk)
        with autocast(recipe, device):
            logits_s, logits_t = head_s(flat_s[sl]), head_t(hidden_t[sl])  # [t, V]
        stats = kl_ce_chunk(logits_s, logits_t, targets[sl], grad_scales=scales)
        del logits_s, logits_t
        grad_logits = stats.grad
        assert grad_logits is not None
        kl += stats.kl
        ce += stats.ce
        with autocast(recipe, device):
            grad_hidden[sl] = grad_logits.to(head_s.weight.dtype) @ head_s.weight  # [t, D]
            if grad_head is not None:
                grad_head += grad_logits.t().to(flat_s.dtype) @ flat_s[sl]  # [V, D]
    return kl, ce, grad_hidden, grad_head
