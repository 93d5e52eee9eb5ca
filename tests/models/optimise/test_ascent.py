"""The chain optimiser: beats contiguous and random, block-wise fixed points, variants, restarts, errors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from models.optimise import block_improvement, contiguous_layout, is_block_optimal, optimise, score, upper_bound
from tests.models.optimise.kit import affinity_of, all_balanced, random_layout


def _balanced(arr: np.ndarray, devices: int) -> bool:
    return all((np.bincount(row, minlength=devices) == arr.shape[1] // devices).all() for row in arr)


@pytest.mark.parametrize(("layers", "groups", "neurons", "devices"), [(4, 8, 64, 4), (3, 8, 48, 2), (3, 6, 24, 3)])
def test_optimise_beats_contiguous_and_random_and_is_a_fixed_point(layers: int, groups: int, neurons: int,
                                                                   devices: int) -> None:
    affinity = affinity_of(layers, groups, neurons, seed=neurons)
    result = optimise(affinity, devices)
    heads, cells = result.kv_group_device, result.neuron_device
    optimised = result.report.J
    assert heads.shape == (layers, groups) and cells.shape == (layers, neurons)
    assert _balanced(heads, devices) and _balanced(cells, devices)
    assert optimised == pytest.approx(score(affinity, heads, cells).J)
    assert optimised == pytest.approx(result.history[-1])
    assert result.sweeps == len(result.history)
    assert all(b >= a - 1e-12 for a, b in itertools.pairwise(result.history))
    assert optimised >= score(affinity, *contiguous_layout(affinity, devices)).J
    assert all(optimised >= score(affinity, *random_layout(affinity, devices, s)).J for s in range(50))
    assert optimised <= result.report.upper_bound + 1e-12
    assert is_block_optimal(affinity, heads, cells)
    assert block_improvement(affinity, heads, cells) <= 1e-12


def test_optimised_blocks_beat_every_balanced_alternative() -> None:
    # N=2, G=4, I=8, L=2: enumerate every balanced assignment of each block with the others held fixed.
    affinity = affinity_of(2, 4, 8, seed=11)
    result = optimise(affinity, 2)
    best = result.report.J
    for i in range(2):
        for row in all_balanced(8, 2):
            cells = result.neuron_device.copy()
            cells[i] = row
            alternative = score(affinity, result.kv_group_device, cells).J
            assert alternative <= best + 1e-12
        for row in all_balanced(4, 2):
            heads = result.kv_group_device.copy()
            heads[i] = row
            alternative = score(affinity, heads, result.neuron_device).J
            assert alternative <= best + 1e-12


def test_minimise_goes_below_contiguous_and_is_a_fixed_point() -> None:
    affinity = affinity_of(3, 8, 32, seed=4)
    result = optimise(affinity, 4, maximise=False)
    contiguous = score(affinity, *contiguous_layout(affinity, 4)).J
    minimised = result.report.J
    assert minimised <= contiguous
    assert minimised < result.report.random_expectation
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(result.history))
    assert is_block_optimal(affinity, result.kv_group_device, result.neuron_device, maximise=False)


def test_variants_keep_frozen_parts_contiguous() -> None:
    affinity = affinity_of(4, 8, 32, seed=9)
    heads0, cells0 = contiguous_layout(affinity, 4)
    full = optimise(affinity, 4).report.J

    neurons_only = optimise(affinity, 4, move_heads=False)
    assert np.array_equal(neurons_only.kv_group_device, heads0)
    assert not np.array_equal(neurons_only.neuron_device, cells0)
    assert is_block_optimal(affinity, neurons_only.kv_group_device, neurons_only.neuron_device, move_heads=False)

    heads_only = optimise(affinity, 4, move_neurons=False)
    assert np.array_equal(heads_only.neuron_device, cells0)
    assert not np.array_equal(heads_only.kv_group_device, heads0)
    assert is_block_optimal(affinity, heads_only.kv_group_device, heads_only.neuron_device, move_neurons=False)

    subset = optimise(affinity, 4, layers=[1, 2])
    for i in (0, 3):
        assert np.array_equal(subset.kv_group_device[i], heads0[i])
        assert np.array_equal(subset.neuron_device[i], cells0[i])
    assert is_block_optimal(affinity, subset.kv_group_device, subset.neuron_device, layers=[1, 2])

    contiguous = score(affinity, heads0, cells0).J
    for variant in (neurons_only, heads_only, subset):
        assert contiguous <= variant.report.J <= full + 1e-9


def test_optimise_is_deterministic_and_reuses_bound() -> None:
    affinity = affinity_of(3, 8, 32, seed=2)
    bound = upper_bound(affinity, 4)
    a = optimise(affinity, 4, bound=bound)
    b = optimise(affinity_of(3, 8, 32, seed=2), 4)
    assert np.array_equal(a.kv_group_device, b.kv_group_device)
    assert np.array_equal(a.neuron_device, b.neuron_device)
    assert a.report == b.report


def test_optimise_single_layer_and_one_device() -> None:
    affinity = affinity_of(1, 4, 8, seed=0)
    result = optimise(affinity, 2)
    assert result.report.down_fraction == []
    # Coordinate ascent is local: even a single edge may stop below its exact maximum.
    optimised = result.report.J
    assert optimised <= result.report.upper_bound + 1e-12
    assert is_block_optimal(affinity, result.kv_group_device, result.neuron_device)
    whole = optimise(affinity, 1).report
    everything = whole.J
    assert everything == pytest.approx(1.0) and whole.upper_bound == pytest.approx(1.0)


@pytest.mark.parametrize(("groups", "neurons", "devices", "message"), [
    (8, 32, 3, r"devices L=3 does not divide num_kv_groups=8 and intermediate_size=32; valid L: 1, 2, 4, 8"),
    (8, 36, 8, r"does not divide intermediate_size=36; valid L: 1, 2, 4$"),
    (8, 32, 0, r"devices must be a positive integer"),
])
def test_devices_must_divide(groups: int, neurons: int, devices: int, message: str) -> None:
    affinity = affinity_of(2, groups, neurons, seed=0)
    with pytest.raises(ValueError, match=message):
        optimise(affinity, devices)
    with pytest.raises(ValueError, match=message):
        upper_bound(affinity, devices)


def test_optimise_argument_errors() -> None:
    affinity = affinity_of(2, 4, 8, seed=0)
    with pytest.raises(ValueError, match=r"layers: \[5\] out of range for N=2"):
        optimise(affinity, 2, layers=[0, 5])
    with pytest.raises(ValueError, match="max_sweeps"):
        optimise(affinity, 2, max_sweeps=0)


def test_optimise_with_all_zero_edges() -> None:
    affinity = affinity_of(3, 4, 16, seed=6, zero_edges=("up1", "down0", "down1"))
    result = optimise(affinity, 2)
    report = result.report
    assert np.isfinite([report.J, report.upper_bound, report.random_expectation]).all()
    assert report.random_expectation == pytest.approx(2 / 2)  # two edges carry mass
    assert report.up_fraction[1] == 0.0 and report.down_fraction == [0.0, 0.0]
    assert is_block_optimal(affinity, result.kv_group_device, result.neuron_device)


def test_restarts_never_lose_and_escape_the_contiguous_start():
    """Random head restarts keep the best ascent: never below the contiguous start, deterministic per
    seed, and on planted structure they find heads that the contiguous start never moves to."""
    from bench.optimiser import synthetic_affinity

    affinity = synthetic_affinity(6, 8, 64, 4, seed=3)
    plain = optimise(affinity, 4)
    again = optimise(affinity, 4, restarts=6, seed=1)
    once_more = optimise(affinity, 4, restarts=6, seed=1)
    assert again.report.J >= plain.report.J - 1e-12
    assert again.report.J == once_more.report.J
    assert np.array_equal(again.kv_group_device, once_more.kv_group_device)
    assert is_block_optimal(affinity, again.kv_group_device, again.neuron_device, devices=4)
    anti = optimise(affinity, 4, maximise=False, restarts=6)
    assert anti.report.J <= optimise(affinity, 4, maximise=False).report.J + 1e-12
    with pytest.raises(ValueError, match="restarts"):
        optimise(affinity, 4, restarts=-1)
