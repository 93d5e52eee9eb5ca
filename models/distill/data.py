"""Training and evaluation blocks of a comparison, and the order in which a run reads them.

The training seed only changes the block order, a pure function of (seed, step), so a resumed run
reads exactly the blocks it would have read.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from models.data.calibration import load_blocks
from models.data.heldout import Placement, place
from models.distill.spec import DistillSpec


@lru_cache(maxsize=8)
def _epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_indices(step: int, *, batch_size: int, num_blocks: int, seed: int) -> np.ndarray:
    """Block indices of optimiser step `step`: consecutive slices of seeded per-epoch permutations.

    A pure function of (seed, step), so a resumed run reads exactly the blocks it would have read.
    """
    flat = np.arange(step * batch_size, (step + 1) * batch_size)
    epochs, positions = np.divmod(flat, num_blocks)
    return np.array([_epoch_order(seed, int(e), num_blocks)[p] for e, p in zip(epochs, positions, strict=True)])


def place_data(spec: DistillSpec) -> Placement:
    """Where training and evaluation read (`models.data.heldout.place`): training after the calibration
    blocks and evaluation after both, where they share a text, unless the spec allows overlap."""
    return place(spec.train, spec.eval, calibration=spec.calibration, calibration_identity=spec.calibration_identity,
                 allow_overlap=spec.allow_overlap)


def load_data(spec: DistillSpec, *, tokenizer: Any, vocab_size: int,
              placement: Placement | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Training and evaluation blocks, placed by `place_data` (held out unless the spec allows overlap)."""
    placement = placement or place_data(spec)
    assert placement.train is not None
    train_spec = replace(placement.train, seed=0)  # the block order belongs to each run's seed
    return (load_blocks(train_spec, tokenizer, vocab_size=vocab_size),
            load_blocks(placement.eval, tokenizer, vocab_size=vocab_size))
