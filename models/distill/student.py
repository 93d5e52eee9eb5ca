"""The student and the teacher: the DTP model of a layout over an fp32 copy of the frozen dense model.

A permutation does not change the dense model, so the teacher is the dense model itself; the
student is the DTP simulator (L, δ, or any communication schedule: `models.schedules.grammar`) over the
permuted weights of the layout.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from models.distill.recipe import DistillRecipe
from models.export.resident import permuted_copy
from models.layouts.layout import Layout
from models.schedules.grammar import ScheduleSpec
from models.sim.dtp import DTPModel


def make_student(teacher: nn.Module, layout: Layout, recipe: DistillRecipe,
                 schedule: ScheduleSpec | None = None) -> DTPModel:
    """A DTP model over an fp32 deep copy of the teacher permuted by `layout` (no shared parameters),
    simulating `schedule` (None: the layout's dtp:δ)."""
    permuted = permuted_copy(teacher, layout)
    inner: Any = permuted
    for p in permuted.parameters():
        # fp32 master weights. Not `.float()`: transformers refuses it on models loaded from GGUF.
        if p.dtype != torch.float32:
            p.data = p.data.float()
        p.requires_grad_(True)
    if recipe.freeze_embeddings:
        inner.model.embed_tokens.weight.requires_grad_(False)  # tied LM head: the same Parameter
    if recipe.freeze_lm_head:
        for p in inner.lm_head.parameters():
            p.requires_grad_(False)
    return DTPModel(permuted, devices=layout.devices, delta=layout.delta if schedule is None else None,
                    schedule=schedule, last_scale=recipe.last_scale,
                    gradient_checkpointing=recipe.gradient_checkpointing)


def trainable_parameters(student: DTPModel) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in student.named_parameters() if p.requires_grad]


def autocast(recipe: DistillRecipe, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast where the recipe asks for it on this device (see `DistillRecipe.use_bf16`)."""
    if not recipe.use_bf16(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def lm_head(model: Any) -> nn.Linear:
    head = model.lm_head
    assert isinstance(head, nn.Linear)
    return head
