"""Shared pieces of the distillation tests: a small fast recipe, a layout, and one run over a directory."""

from __future__ import annotations

from models import distill as D
from models.families import model_shape
from models.layouts import layout as lay

VOCAB = 97


def recipe(**overrides) -> D.DistillRecipe:
    base = dict(steps=6, batch_size=4, micro_batch_size=2, lr=2e-3, min_lr=2e-4, warmup_steps=2, eval_every=2,
                checkpoint_every=1, logit_chunk=10, eval_batch_size=2)
    return D.DistillRecipe(**{**base, **overrides})


def layout_of(model, seed: int = 3, devices: int = 2) -> lay.Layout:
    return lay.random(model_shape(model.config), devices, 1, seed=seed)


def run(teacher, train, run_dir, r=None, reference_blocks=None, **kw):
    r = r or recipe()
    blocks = train[:4] if reference_blocks is None else reference_blocks
    reference = D.DenseReference.compute(teacher, blocks, recipe=r)
    return D.distill_run(teacher=teacher, layout=layout_of(teacher), seed=1, recipe=r, train_blocks=train,
                         reference=reference, run_dir=run_dir, **kw)
