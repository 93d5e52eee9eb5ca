"""The learning-rate schedule: linear warm-up, then cosine decay to min_lr (the paper's). Torch-free."""

from __future__ import annotations

import math

from models.distill.recipe import DistillRecipe


def learning_rate(step: int, recipe: DistillRecipe) -> float:
    """The lr of optimiser step `step` (0-based): linear warm-up, then cosine decay to min_lr.

    warm-up (step < W):  lr · (step + 1) / W
    decay:               min_lr + (lr − min_lr) · ½ · (1 + cos(π · (step − W) / (steps − W)))
    """
    warmup = recipe.warmup_steps
    if step < warmup:
        return recipe.lr * (step + 1) / warmup
    span = max(1, recipe.steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return recipe.min_lr + (recipe.lr - recipe.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
