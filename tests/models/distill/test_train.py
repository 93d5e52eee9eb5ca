"""Optimiser steps: what is frozen stays bit-identical, and the teacher is never touched."""

from __future__ import annotations

import pytest
import torch

from models import distill as D
from tests.models.distill.kit import layout_of, recipe
from tests.tiny import tiny_model, tokens


@pytest.mark.parametrize("case", ["llama", "llama-tied-headdim"])
def test_frozen_embeddings_stay_bit_identical_and_teacher_is_untouched(case):
    teacher = tiny_model(case)
    teacher_state = {k: v.clone() for k, v in teacher.state_dict().items()}
    r = recipe()
    student = D.make_student(teacher, layout_of(teacher), r)
    assert not {id(p) for p in student.parameters()} & {id(p) for p in teacher.parameters()}
    emb = student.model.model.embed_tokens.weight
    emb0, head0 = emb.detach().clone(), student.model.lm_head.weight.detach().clone()
    optimizer = D.make_optimizer(student, r)
    for step in range(3):
        D.train_step(student, teacher, tokens(4, 12, seed=step), optimizer, step=step, recipe=r)
    assert torch.equal(emb, emb0) and not emb.requires_grad
    tied = teacher.config.tie_word_embeddings
    # An untied LM head trains by default (only the embeddings are frozen); a tied one is the embedding.
    assert torch.equal(student.model.lm_head.weight, head0) == tied
    for k, v in teacher.state_dict().items():
        assert torch.equal(v, teacher_state[k]), k
    frozen_head = D.make_student(teacher, layout_of(teacher), recipe(freeze_lm_head=True))
    assert not frozen_head.model.lm_head.weight.requires_grad
