"""Objective (6): `score` against the literal double loop of the equation, by hand and on average."""

from __future__ import annotations

import json

import numpy as np
import pytest

from models.optimise import Affinity, contiguous_layout, score
from tests.models.optimise.kit import affinity_of, literal_J, random_layout


@pytest.mark.parametrize(("devices", "seed"), [(2, 0), (2, 1), (4, 2), (4, 3)])
def test_score_matches_literal_equation_6(devices: int, seed: int) -> None:
    affinity = affinity_of(3, 4, 8, seed, zero_edges=("down1",) if seed == 1 else ())
    for layout_seed in range(3):
        heads, cells = random_layout(affinity, devices, layout_seed)
        report = score(affinity, heads, cells)
        objective = report.J
        assert report.devices == devices
        assert objective == pytest.approx(literal_J(affinity, heads, cells), abs=1e-12)
        fractions = np.array([*report.up_fraction, *report.down_fraction])
        assert len(report.up_fraction) == 3 and len(report.down_fraction) == 2
        assert ((fractions >= 0) & (fractions <= 1 + 1e-12)).all()
        assert fractions.sum() == pytest.approx(objective, abs=1e-12)
        assert objective <= report.upper_bound + 1e-12


def test_score_by_hand() -> None:
    # N=2, G=2, I=2, L=2: groups and neurons on devices (0, 1) in both layers.
    up = [np.array([[3.0, 1.0], [0.0, 4.0]]), np.array([[1.0, 1.0], [1.0, 1.0]])]
    down = [np.array([[2.0, 0.0], [1.0, 1.0]])]  # [I, G]
    affinity = Affinity(up, down)
    heads = np.array([[0, 1], [0, 1]])
    cells = np.array([[0, 1], [1, 0]])
    report = score(affinity, heads, cells)
    # up0: (g0,k0)=3 and (g1,k1)=4 of 8; up1: (g0,k1)+(g1,k0)=2 of 4; down0: (k0,g0)=2 and (k1,g1)=1 of 4.
    assert report.up_fraction == pytest.approx([7 / 8, 2 / 4])
    assert report.down_fraction == pytest.approx([3 / 4])
    objective = report.J
    assert objective == pytest.approx(7 / 8 + 1 / 2 + 3 / 4)
    assert report.random_expectation == pytest.approx(3 / 2)
    assert json.loads(json.dumps(report.as_dict())) == report.as_dict()


@pytest.mark.parametrize("devices", [2, 4])
def test_random_layouts_average_the_random_expectation(devices: int) -> None:
    affinity = affinity_of(3, 4, 8, seed=5)
    scores = [score(affinity, *random_layout(affinity, devices, s)).J for s in range(1500)]
    expected = (2 * 3 - 1) / devices
    assert score(affinity, *random_layout(affinity, devices, 0)).random_expectation == pytest.approx(expected)
    standard_error = np.std(scores) / np.sqrt(len(scores))
    assert abs(np.mean(scores) - expected) < 4 * standard_error


def test_score_layout_errors() -> None:
    affinity = affinity_of(2, 4, 8, seed=0)
    heads, cells = contiguous_layout(affinity, 2)
    with pytest.raises(ValueError, match=r"kv_group_device: expected shape \[2, 4\]"):
        score(affinity, heads[:, :3], cells)
    with pytest.raises(ValueError, match=r"neuron_device: expected shape \[2, 8\]"):
        score(affinity, heads, cells[:1])
    unbalanced = cells.copy()
    unbalanced[1, 0] = 1
    with pytest.raises(ValueError, match=r"neuron_device\[1\]: unbalanced"):
        score(affinity, heads, unbalanced)
    with pytest.raises(ValueError, match=r"device ids must be in \[0, 1\]"):
        score(affinity, heads, cells + 1, devices=2)
    with pytest.raises(ValueError, match="integer device ids"):
        score(affinity, heads.astype(float), cells)
