"""Data of a comparison: the seeded block order, and evaluation text held out from training text."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from models import distill as D
from models.data.calibration import CalibrationSpec
from models.schedules.grammar import dtp_spec


def test_batch_order_depends_only_on_seed_and_step():
    order = [D.batch_indices(s, batch_size=4, num_blocks=10, seed=7) for s in range(5)]  # 2 epochs
    flat = np.concatenate(order)
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert not np.array_equal(flat[:10], flat[10:20])  # each epoch has its own order
    again = D.batch_indices(3, batch_size=4, num_blocks=10, seed=7)
    assert np.array_equal(again, order[3])
    other = np.concatenate([D.batch_indices(s, batch_size=4, num_blocks=10, seed=8) for s in range(5)])
    assert sorted(other[:10]) == sorted(flat[:10]) and not np.array_equal(other, flat)


def test_evaluation_skips_past_the_training_text_of_the_same_source(tmp_path):
    np.save(tmp_path / "ids.npy", np.arange(40 * 8))  # token i at position i
    spec = D.DistillSpec(layouts=("contiguous",), devices=2, schedule=dtp_spec(1),
                         train=CalibrationSpec(str(tmp_path / "ids.npy"), sequences=10, seq_len=8, seed=3),
                         eval=CalibrationSpec(str(tmp_path / "ids.npy"), sequences=4, seq_len=16))
    train, evaluation = D.load_data(spec, tokenizer=None, vocab_size=1000)
    assert train.shape == (10, 8) and evaluation.shape == (4, 16)
    assert int(train.max()) < 80 <= int(evaluation.min())
    # The spec's seed does not reorder the blocks: each run's training seed does (batch_indices).
    reseeded = replace(spec, train=replace(spec.train, seed=0))
    assert torch.equal(D.load_data(reseeded, tokenizer=None, vocab_size=1000)[0], train)
