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

from models.calibration import load_blocks
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


def load_data(spec: DistillSpec, *, tokenizer: Any, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training and evaluation blocks; evaluation skips past the training text when they share a source."""
    train_spec = replace(spec.train, seed=0)  # the block order belongs to each run's seed
    eval_spec = spec.eval
    if eval_spec.source == train_spec.source:
        train_tokens = (train_spec.sequences + train_spec.skip_blocks) * train_spec.seq_len
        skip = max(eval_spec.skip_blocks, -(-train_tokens // eval_spec.seq_len))
        eval_spec = replace(eval_spec, skip_blocks=skip)
    return (load_blocks(train_spec, tokenizer, vocab_size=vocab_size),
            load_blocks(eval_spec, tokenizer, vocab_size=vocab_size))
