"""Evaluating a run: the teacher's hidden states on the held-out blocks once, then KL and perplexity."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models.distill.loss import chunked_kl_nll, chunked_nll, next_token_targets
from models.distill.recipe import DistillRecipe
from models.distill.student import autocast, lm_head
from models.dtp import DTPModel


@dataclass
class DenseReference:
    """The teacher's final hidden states on the evaluation blocks, computed once for every run."""

    blocks: torch.Tensor  # [n, S] token ids
    hidden: torch.Tensor  # [n, S, D], the teacher's dtype
    dense_ppl: float

    @classmethod
    def compute(cls, teacher: nn.Module, blocks: torch.Tensor, *, recipe: DistillRecipe) -> DenseReference:
        device = next(teacher.parameters()).device
        teacher_any: Any = teacher
        head = lm_head(teacher)
        hidden, nll = [], 0.0
        with torch.no_grad(), autocast(recipe, device):
            for start in range(0, blocks.shape[0], recipe.eval_batch_size):
                ids = blocks[start : start + recipe.eval_batch_size].to(device)  # [b, S]
                h = teacher_any.model(ids).last_hidden_state  # [b, S, D]
                hidden.append(h)
                nll += chunked_nll(h.reshape(-1, h.shape[-1]), head, next_token_targets(ids), recipe.logit_chunk)
        n, s = blocks.shape
        return cls(blocks=blocks.to(device), hidden=torch.cat(hidden), dense_ppl=math.exp(nll / (n * (s - 1))))


@torch.no_grad()
def evaluate_student(student: DTPModel, teacher: nn.Module, reference: DenseReference, *,
                     recipe: DistillRecipe) -> tuple[float, float]:
    """(mean per-token KL(dense ‖ DTP) in nats over all tokens, DTP perplexity) on the reference blocks."""
    was_training = student.training
    student.eval()
    device = reference.blocks.device
    head_s, head_t = lm_head(student.model), lm_head(teacher)
    kl = nll = 0.0
    n, s = reference.blocks.shape
    with autocast(recipe, device):
        for start in range(0, n, recipe.eval_batch_size):
            ids = reference.blocks[start : start + recipe.eval_batch_size]  # [b, S]
            flat_s = student.hidden_states(ids).reshape(-1, reference.hidden.shape[-1])  # [T, D]
            flat_t = reference.hidden[start : start + recipe.eval_batch_size].reshape(flat_s.shape)
            _, nll_s, kl_sum = chunked_kl_nll(flat_t, flat_s, head_t, head_s, next_token_targets(ids),
                                              recipe.logit_chunk)
            kl += kl_sum
            nll += nll_s
    student.train(was_training)
    return kl / (n * s), math.exp(nll / (n * (s - 1)))
