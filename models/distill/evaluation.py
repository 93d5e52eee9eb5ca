"""Evaluating a run: KL(dense ‖ DTP) and perplexity on the held-out blocks, a micro-batch at a time.

Every forward holds at most `recipe.eval_rows(S)` sequences (MAX_FORWARD_TOKENS tokens): the teacher's
hidden states are recomputed per micro-batch, never kept for the whole set, so the memory an
evaluation holds does not grow with the number of blocks. `should_stop` is asked before every
micro-batch (a cancel lands within one forward, however large the evaluation).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from models.base.progress import Cancelled, ShouldStop
from models.distill.loss import chunked_kl_nll, chunked_nll, next_token_targets, teacher_hidden
from models.distill.recipe import DistillRecipe
from models.distill.student import autocast, lm_head
from models.sim.dtp import DTPModel, gathered


@dataclass
class DenseReference:
    """The evaluation blocks and the dense model's perplexity on them, computed once for every run."""

    blocks: torch.Tensor  # [n, S] token ids, on the teacher's device
    dense_ppl: float

    @classmethod
    def compute(cls, teacher: nn.Module, blocks: torch.Tensor, *, recipe: DistillRecipe,
                should_stop: ShouldStop | None = None, done: Callable[[float], None] | None = None
                ) -> DenseReference:
        """done(fraction) after each micro-batch: the fraction of the blocks read."""
        device = next(teacher.parameters()).device
        nll = 0.0
        with torch.no_grad(), autocast(recipe, device):
            for ids in _micro_batches(blocks, recipe, should_stop, "the dense model's evaluation", done):
                ids = ids.to(device)  # [b, S]
                nll += gathered(teacher, _dense_nll, teacher, ids, recipe.logit_chunk)
        n, s = blocks.shape
        return cls(blocks=blocks.to(device), dense_ppl=math.exp(nll / (n * (s - 1))))


@torch.no_grad()
def evaluate_student(student: DTPModel, teacher: nn.Module, reference: DenseReference, *,
                     recipe: DistillRecipe, should_stop: ShouldStop | None = None,
                     done: Callable[[float], None] | None = None) -> tuple[float, float]:
    """(mean per-token KL(dense ‖ DTP) in nats over all tokens, DTP perplexity) on the reference blocks.

    Raises `Cancelled` before a micro-batch when should_stop() is true; done(fraction) after each one."""
    was_training = student.training
    student.eval()
    device = reference.blocks.device
    kl = nll = 0.0
    n, s = reference.blocks.shape
    try:
        with autocast(recipe, device):
            for ids in _micro_batches(reference.blocks, recipe, should_stop, "an evaluation", done):  # [b, S]
                # both models whole at their roots (FSDP2: the teacher's method inside the student's)
                _, nll_s, kl_sum = gathered(student, gathered, teacher, _sums, student, teacher, ids,
                                            recipe.logit_chunk)
                kl += kl_sum
                nll += nll_s
    finally:
        student.train(was_training)
    return kl / (n * s), math.exp(nll / (n * (s - 1)))


def _sums(student: DTPModel, teacher: nn.Module, ids: torch.Tensor, chunk: int) -> tuple[float, float, float]:
    """(teacher NLL, student NLL, KL) sums of one batch [b, S]; runs inside both models' `gathered`."""
    flat_t = teacher_hidden(teacher, ids)
    flat_t = flat_t.reshape(-1, flat_t.shape[-1])  # [T, D]
    flat_s = student.hidden_states(ids).reshape(flat_t.shape)  # [T, D]
    return chunked_kl_nll(flat_t, flat_s, lm_head(teacher), lm_head(student.model), next_token_targets(ids), chunk)


def _dense_nll(teacher: nn.Module, ids: torch.Tensor, chunk: int) -> float:
    """The teacher's NLL sum over ids [b, S]; runs inside its `gathered` (whole LM head)."""
    h = teacher_hidden(teacher, ids)  # [b, S, D]
    return chunked_nll(h.reshape(-1, h.shape[-1]), lm_head(teacher), next_token_targets(ids), chunk)


def _micro_batches(blocks: torch.Tensor, recipe: DistillRecipe, should_stop: ShouldStop | None,
                   what: str, done: Callable[[float], None] | None = None) -> Iterator[torch.Tensor]:
    """blocks [n, S] in slices of recipe.eval_rows(S) sequences, should_stop asked before each and
    done(fraction of the blocks) told after each."""
    rows = recipe.eval_rows(blocks.shape[1])
    n = blocks.shape[0]
    for start in range(0, n, rows):
        if should_stop is not None and should_stop():
            raise Cancelled(f"{what} cancelled at block {start} of {n}")
        yield blocks[start : start + rows]
        if done is not None:
            done(min(n, start + rows) / n)
