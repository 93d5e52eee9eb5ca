"""The optimiser's input: affinity shapes, normalisation and the errors that name the bad matrix."""

from __future__ import annotations

import numpy as np
import pytest

from models.optimise import Affinity
from tests.models.optimise.kit import affinity_of


def test_affinity_shapes_and_normalisation() -> None:
    affinity = affinity_of(3, 4, 8, seed=0, zero_edges=("up1", "down0"))
    assert (affinity.num_layers, affinity.num_kv_groups, affinity.intermediate_size) == (3, 4, 8)
    unit = affinity.normalised()
    assert unit is affinity.normalised() and unit.normalised() is unit
    masses = unit.edge_masses()
    assert masses.tolist() == pytest.approx([1.0, 0.0, 1.0, 0.0, 1.0])
    assert not np.isnan(unit.up[1]).any() and not unit.up[1].any()
    with pytest.raises(ValueError):
        affinity.up[0][0, 0] = 1.0  # stored read-only


@pytest.mark.parametrize(("up_shapes", "down_shapes", "message"), [
    ([(4, 8), (4, 8)], [], r"down: expected N-1=1 matrices for N=2 layers, got 0"),
    ([(4, 8), (4, 6)], [(8, 4)], r"up\[1\]: expected shape \[4, 8\]"),
    ([(4, 8), (4, 8)], [(4, 8)], r"down\[0\]: expected shape \[8, 4\]"),
    ([], [], r"up: need at least one layer"),
    ([(4,)], [], r"up\[0\]: expected a non-empty 2-D"),
])
def test_affinity_shape_errors_name_layer_and_field(up_shapes: list[tuple[int, ...]],
                                                     down_shapes: list[tuple[int, ...]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Affinity([np.ones(s) for s in up_shapes], [np.ones(s) for s in down_shapes])


@pytest.mark.parametrize(("bad", "message"), [(-1.0, r"up\[1\]: affinities must be non-negative"),
                                              (np.nan, r"up\[1\]: contains NaN")])
def test_affinity_value_errors(bad: float, message: str) -> None:
    up = [np.ones((4, 8)), np.ones((4, 8))]
    up[1][2, 3] = bad
    with pytest.raises(ValueError, match=message):
        Affinity(up, [np.ones((8, 4))])
