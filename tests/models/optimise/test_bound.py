"""The upper bound of J: exact per edge against brute force, and the relaxed bound where enumeration is too big."""

from __future__ import annotations

import pytest

from models.optimise import contiguous_layout, partition_count, score, upper_bound
from tests.models.optimise.kit import affinity_of, brute_edge_max


def test_partition_count() -> None:
    assert partition_count(8, 4) == 105
    assert partition_count(8, 2) == 35
    assert partition_count(8, 8) == 1
    assert partition_count(16, 4) == 2627625


@pytest.mark.parametrize(("groups", "neurons", "devices"),
                         [(4, 8, 2), (4, 8, 4), (6, 6, 3), (6, 6, 2), (8, 4, 4), (4, 4, 1)])
def test_upper_bound_equals_brute_force_per_edge_maximum(groups: int, neurons: int, devices: int) -> None:
    affinity = affinity_of(2, groups, neurons, seed=groups + devices, zero_edges=("up1",))
    bound = upper_bound(affinity, devices)
    unit = affinity.normalised()
    expected_up = [brute_edge_max(m, devices) for m in unit.up]
    expected_down = [brute_edge_max(m.T, devices) for m in unit.down]
    assert bound.exact
    assert bound.up == pytest.approx(expected_up, abs=1e-12)
    assert bound.down == pytest.approx(expected_down, abs=1e-12)
    assert bound.value == pytest.approx(sum(expected_up) + sum(expected_down), abs=1e-12)
    assert upper_bound(affinity, devices) is bound  # computed once per affinity


def test_relaxed_upper_bound_is_valid_but_not_exact() -> None:
    affinity = affinity_of(2, 4, 8, seed=3)
    exact = upper_bound(affinity, 2)
    relaxed = upper_bound(affinity, 2, max_partitions=1)
    assert exact.exact and not relaxed.exact
    assert relaxed.value >= exact.value - 1e-12
    assert relaxed.value <= 3 + 1e-12
    report = score(affinity, *contiguous_layout(affinity, 2), bound=relaxed)
    assert report.upper_bound == relaxed.value and not report.upper_bound_exact
    with pytest.raises(ValueError, match="bound was computed for L=2 devices, the layout has L=4"):
        score(affinity, *contiguous_layout(affinity, 4), bound=relaxed)
