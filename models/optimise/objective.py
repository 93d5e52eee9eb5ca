"""Objective (6) of the paper: the co-located normalised affinity J of a balanced layout.

A layout puts KV group g of layer i on device h_i(g) and FFN neuron k on device ν_i(k), balanced
(G/L groups and I/L neurons per device). With every edge normalised to unit mass,

    J = Σ_i Σ_{g,k: h_i(g)=ν_i(k)} Ŝup_i[g, k] + Σ_{i<N-1} Σ_{k,g: ν_i(k)=h_{i+1}(g)} Ŝdown_i[k, g],

in [0, 2N-1]; a uniformly random layout scores (2N-1)/L in expectation. Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from models.optimise.bound import UpperBound, upper_bound
from models.optimise.problem import Affinity, check_devices


def check_layout(affinity: Affinity, kv_group_device: Any, neuron_device: Any,
                 devices: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    """The device arrays as int64 [N, G] and [N, I] and L; ValueError unless balanced over L devices."""
    n, groups, neurons = affinity.num_layers, affinity.num_kv_groups, affinity.intermediate_size
    heads = np.asarray(kv_group_device)
    cells = np.asarray(neuron_device)
    for name, arr, width in (("kv_group_device", heads, groups), ("neuron_device", cells, neurons)):
        if arr.shape != (n, width):
            raise ValueError(f"{name}: expected shape [{n}, {width}], got {list(arr.shape)}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{name}: expected integer device ids, got dtype {arr.dtype}")
    if devices is None:
        # Every device of a balanced layout holds at least one group, so the largest id is L - 1.
        devices = int(heads.max()) + 1
    check_devices(affinity, devices)
    for name, arr, width in (("kv_group_device", heads, groups), ("neuron_device", cells, neurons)):
        if arr.min() < 0 or arr.max() >= devices:
            raise ValueError(f"{name}: device ids must be in [0, {devices - 1}], found {arr.min()}..{arr.max()}")
        counts = np.stack([np.bincount(row, minlength=devices) for row in arr])  # [N, L]
        bad_layers = np.flatnonzero((counts != width // devices).any(axis=1))
        if bad_layers.size:
            i = int(bad_layers[0])
            raise ValueError(f"{name}[{i}]: unbalanced, per-device counts {counts[i].tolist()}, "
                             f"expected {width // devices} on each of {devices} devices")
    return heads.astype(np.int64), cells.astype(np.int64), int(devices)


def _stacked(unit: Affinity) -> tuple[np.ndarray, np.ndarray]:
    """All up matrices [N, G, I] and down matrices [N-1, I, G], stacked once per affinity."""
    if "stacked" not in unit._cache:
        groups, neurons = unit.num_kv_groups, unit.intermediate_size
        down = np.stack(unit.down) if unit.down else np.zeros((0, neurons, groups))
        unit._cache["stacked"] = (np.stack(unit.up), down)
    stacked: tuple[np.ndarray, np.ndarray] = unit._cache["stacked"]
    return stacked


def _co_located(unit: Affinity, heads: np.ndarray, cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Co-located mass of each up edge [N] and each down edge [N-1] of a normalised affinity."""
    up, down = _stacked(unit)  # [N, G, I], [N-1, I, G]
    up_together = heads[:, :, None] == cells[:, None, :]  # [N, G, I]
    up_fraction = np.where(up_together, up, 0.0).sum(axis=(1, 2))
    down_together = cells[:-1, :, None] == heads[1:, None, :]  # [N-1, I, G]
    down_fraction = np.where(down_together, down, 0.0).sum(axis=(1, 2))
    return up_fraction, down_fraction



def objective(unit: Affinity, heads: np.ndarray, cells: np.ndarray) -> float:
    """J of checked [N, G] / [N, I] device arrays over a normalised affinity."""
    up_fraction, down_fraction = _co_located(unit, heads, cells)
    return float(up_fraction.sum() + down_fraction.sum())


@dataclass(frozen=True)
class ScoreReport:
    J: float
    devices: int
    random_expectation: float
    up_fraction: list[float]
    down_fraction: list[float]
    upper_bound: float
    upper_bound_exact: bool

    def as_dict(self) -> dict[str, Any]:
        return {
            "J": self.J,
            "devices": self.devices,
            "random_expectation": self.random_expectation,
            "up_fraction": list(self.up_fraction),
            "down_fraction": list(self.down_fraction),
            "upper_bound": self.upper_bound,
            "upper_bound_exact": self.upper_bound_exact,
        }


def score(affinity: Affinity, kv_group_device: Any, neuron_device: Any, *, devices: int | None = None,
          bound: UpperBound | None = None) -> ScoreReport:
    """Objective (6) of a balanced layout, its per-edge co-located fractions and the upper bound.

    kv_group_device: [N, G] ints; neuron_device: [N, I] ints. `devices` defaults to the largest id + 1.
    The random expectation is the total normalised mass over L: (2N-1)/L unless an edge is all zero.
    """
    heads, cells, devices = check_layout(affinity, kv_group_device, neuron_device, devices)
    unit = affinity.normalised()
    up_fraction, down_fraction = _co_located(unit, heads, cells)
    if bound is None:
        bound = upper_bound(affinity, devices)
    elif bound.devices != devices:
        raise ValueError(f"bound was computed for L={bound.devices} devices, the layout has L={devices}")
    return ScoreReport(
        J=float(up_fraction.sum() + down_fraction.sum()),
        devices=devices,
        random_expectation=float(unit.edge_masses().sum() / devices),
        up_fraction=up_fraction.tolist(),
        down_fraction=down_fraction.tolist(),
        upper_bound=bound.value,
        upper_bound_exact=bound.exact,
    )

