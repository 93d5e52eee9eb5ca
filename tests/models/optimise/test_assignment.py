"""The transportation solver: exact against the Hungarian method on replicated slots, any capacities."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from models.optimise import balanced_assignment, transport


def _gains(kind: str, n: int, devices: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "uniform":
        return rng.random((n, devices))
    if kind == "lognormal":
        return rng.lognormal(0.0, 2.5, (n, devices))
    if kind == "pareto":
        return rng.pareto(0.8, (n, devices))
    if kind == "ties":
        return rng.integers(0, 3, (n, devices)).astype(np.float64)
    if kind == "equal":
        return np.full((n, devices), 0.25)
    if kind == "signed":
        return rng.normal(0.0, 1.0, (n, devices)) * 1e3
    raise AssertionError(kind)


def _reference_total(gain: np.ndarray, maximise: bool, capacities: list[int] | None = None) -> float:
    """Hungarian on replicated slots: device column l repeated capacities[l] times (default n/L)."""
    n, devices = gain.shape
    repeats = capacities if capacities is not None else [n // devices] * devices
    slots = np.repeat(gain, repeats, axis=1)  # [n, n]
    rows, cols = linear_sum_assignment(slots, maximize=maximise)
    return float(slots[rows, cols].sum())


def _total(gain: np.ndarray, assign: np.ndarray) -> float:
    return float(gain[np.arange(len(assign)), assign].sum())


KINDS = ["uniform", "lognormal", "pareto", "ties", "equal", "signed"]


@pytest.mark.parametrize("maximise", [True, False])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("devices", [2, 3, 4, 8])
def test_balanced_assignment_matches_hungarian(devices: int, kind: str, maximise: bool) -> None:
    rng = np.random.default_rng([devices, KINDS.index(kind), int(maximise)])
    for per_device in [1, 2, 3, 7, 16, 40]:
        for _ in range(3):
            gain = _gains(kind, devices * per_device, devices, rng)
            assign = balanced_assignment(gain, maximise=maximise)
            assert assign.dtype == np.int64 and assign.shape == (len(gain),)
            assert np.bincount(assign, minlength=devices).tolist() == [per_device] * devices
            expected = _reference_total(gain, maximise)
            assert _total(gain, assign) == pytest.approx(expected, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("kind", ["lognormal", "ties", "pareto"])
def test_balanced_assignment_matches_hungarian_at_scale(kind: str) -> None:
    rng = np.random.default_rng(7)
    gain = _gains(kind, 1024, 4, rng)
    assign = balanced_assignment(gain)
    assert np.bincount(assign).tolist() == [256] * 4
    assert _total(gain, assign) == pytest.approx(_reference_total(gain, True), rel=1e-9)


def test_balanced_assignment_is_deterministic_with_ties() -> None:
    gain = np.random.default_rng(0).integers(0, 2, (64, 4)).astype(np.float64)
    first = balanced_assignment(gain)
    assert all(np.array_equal(first, balanced_assignment(gain.copy())) for _ in range(3))


def test_balanced_assignment_trivial_sizes() -> None:
    assert balanced_assignment(np.zeros((0, 3))).shape == (0,)
    assert balanced_assignment(np.ones((5, 1))).tolist() == [0] * 5
    # One unit per device: a plain permutation problem.
    gain = np.array([[0.0, 5.0], [1.0, 9.0]])  # 0 + 9 against 5 + 1
    assert balanced_assignment(gain).tolist() == [0, 1]
    assert balanced_assignment(gain, maximise=False).tolist() == [1, 0]


@pytest.mark.parametrize(("gain", "message"), [
    (np.ones((5, 2)), "multiple of the number of devices"),
    (np.array([[1.0, np.nan], [0.0, 1.0]]), "NaN"),
    (np.array([[1.0, np.inf], [0.0, 1.0]]), "finite"),
    (np.ones(4), "2-D"),
    (np.ones((4, 0)), "at least one device"),
])
def test_balanced_assignment_errors(gain: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        balanced_assignment(gain)


@pytest.mark.parametrize("maximise", [True, False])
@pytest.mark.parametrize("kind", ["uniform", "lognormal", "ties", "signed"])
def test_transport_with_unequal_capacities_matches_hungarian(kind: str, maximise: bool) -> None:
    rng = np.random.default_rng([KINDS.index(kind), int(maximise)])
    for capacities in ([1, 2, 5], [7, 0, 3, 1], [0, 12], [3, 3, 0, 9, 1], [20, 1]):
        n = sum(capacities)
        gain = _gains(kind, n, len(capacities), rng)
        assign = transport(gain, capacities, maximise=maximise)
        assert assign.dtype == np.int64
        assert np.bincount(assign, minlength=len(capacities)).tolist() == capacities
        expected = _reference_total(gain, maximise, capacities)
        assert _total(gain, assign) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_transport_equal_capacities_is_the_balanced_assignment() -> None:
    gain = np.random.default_rng(3).lognormal(0.0, 2.0, (48, 4))
    assert np.array_equal(transport(gain, [12] * 4), balanced_assignment(gain))


@pytest.mark.parametrize(("capacities", "message"), [
    ([2, 2], "sum to 4, but there are 5 units"),
    ([6, -1], "≥ 0"),
    ([5], r"one per sink \(2\)"),
    ([2.5, 2.5], "integers"),
])
def test_transport_capacity_errors(capacities: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        transport(np.ones((5, 2)), capacities)
