"""The lr schedule against its formula: linear warm-up, cosine decay to min_lr."""

from __future__ import annotations

import itertools
import math

import pytest

from models import distill as D


def test_learning_rate_schedule_matches_the_formula():
    r = D.DistillRecipe(steps=1000, warmup_steps=100, lr=5e-5, min_lr=5e-6)
    assert D.learning_rate(0, r) == pytest.approx(5e-7)
    assert D.learning_rate(49, r) == pytest.approx(2.5e-5)
    assert D.learning_rate(99, r) == pytest.approx(5e-5)
    assert D.learning_rate(100, r) == pytest.approx(5e-5)
    assert D.learning_rate(550, r) == pytest.approx(5e-6 + 4.5e-5 * 0.5)  # half way through the cosine
    assert D.learning_rate(325, r) == pytest.approx(5e-6 + 4.5e-5 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert D.learning_rate(999, r) == pytest.approx(5e-6, rel=1e-3)
    assert D.learning_rate(1000, r) == pytest.approx(5e-6)
    lrs = [D.learning_rate(s, r) for s in range(100, 1000)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))
    assert D.learning_rate(0, D.DistillRecipe(warmup_steps=0)) == pytest.approx(5e-5)
