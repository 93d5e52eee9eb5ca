"""J_σ: the layout objective of a communication schedule (issue 20), its upper bound and its report.

    J_σ(layout) = Σ_{(m, t) edges of σ}  Σ_{u ∈ m, v ∈ t}  Ŝ_{m→t}[u, v] · 1[dev(u) = dev(v)]

over the edges of `models.optimise.edges` (Ŝ: each edge at unit mass). At dtp:1 the edges are the chain's
and J_σ is objective (6) of the paper (`models.optimise.objective`); tp and ladder have no edge and
J_σ = 0 for every layout. Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from models.optimise.bound import _edge_bound
from models.optimise.edges import (
    EdgeMatrix,
    Pair,
    ScheduleAffinity,
    TopRows,
    co_located,
    edge_kind,
    edge_name,
    module_devices,
)
from models.optimise.problem import contiguous_row, valid_device_counts


def check_devices_for(affinity: ScheduleAffinity, devices: int) -> None:
    groups, neurons = affinity.num_kv_groups, affinity.intermediate_size
    if not isinstance(devices, int | np.integer) or devices < 1:
        raise ValueError(f"devices must be a positive integer, got {devices!r}")
    bad = [f"{name}={size}" for name, size in (("num_kv_groups", groups), ("intermediate_size", neurons))
           if size % devices]
    if bad:
        valid = ", ".join(map(str, valid_device_counts(groups, neurons)))
        raise ValueError(f"devices L={devices} does not divide {' and '.join(bad)}; valid L: {valid}")


def check_schedule_layout(affinity: ScheduleAffinity, kv_group_device: Any, neuron_device: Any,
                          devices: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    """The device arrays as int64 [N, G] / [N, I] and L; ValueError unless balanced over L devices."""
    n = affinity.num_layers
    heads, cells = np.asarray(kv_group_device), np.asarray(neuron_device)
    for name, arr, width in (("kv_group_device", heads, affinity.num_kv_groups),
                             ("neuron_device", cells, affinity.intermediate_size)):
        if arr.shape != (n, width):
            raise ValueError(f"{name}: expected shape [{n}, {width}], got {list(arr.shape)}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{name}: expected integer device ids, got dtype {arr.dtype}")
    if devices is None:
        devices = int(heads.max()) + 1
    check_devices_for(affinity, devices)
    for name, arr, width in (("kv_group_device", heads, affinity.num_kv_groups),
                             ("neuron_device", cells, affinity.intermediate_size)):
        if arr.min() < 0 or arr.max() >= devices:
            raise ValueError(f"{name}: device ids must be in [0, {devices - 1}], found {arr.min()}..{arr.max()}")
        counts = np.stack([np.bincount(row, minlength=devices) for row in arr])  # [N, L]
        bad = np.flatnonzero((counts != width // devices).any(axis=1))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{name}[{i}]: unbalanced, per-device counts {counts[i].tolist()}, "
                             f"expected {width // devices} on each of {devices} devices")
    return heads.astype(np.int64), cells.astype(np.int64), int(devices)


def contiguous_schedule_layout(affinity: ScheduleAffinity, devices: int) -> tuple[np.ndarray, np.ndarray]:
    check_devices_for(affinity, devices)
    n = affinity.num_layers
    return (np.tile(contiguous_row(affinity.num_kv_groups, devices), (n, 1)),
            np.tile(contiguous_row(affinity.intermediate_size, devices), (n, 1)))


def edge_fractions(unit: ScheduleAffinity, heads: np.ndarray, cells: np.ndarray) -> dict[Pair, float]:
    """The co-located fraction of every edge of a normalised affinity."""
    return {pair: co_located(matrix, module_devices(heads, cells, pair[0]), module_devices(heads, cells, pair[1]))
            for pair, matrix in unit.edges.items()}


def schedule_objective(unit: ScheduleAffinity, heads: np.ndarray, cells: np.ndarray) -> float:
    """J_σ of checked device arrays over a normalised affinity."""
    return float(sum(edge_fractions(unit, heads, cells).values()))


def _one_edge_bound(matrix: EdgeMatrix, devices: int, max_partitions: int) -> tuple[float, bool]:
    """The best co-located fraction of one normalised edge alone; (value, exact)."""
    if isinstance(matrix, TopRows):
        return _top_rows_bound(matrix, devices), False
    rows, cols = matrix.shape
    # _edge_bound enumerates the partitions of its first axis: give it the smaller side.
    # (a down edge [I, G] is bounded as its transpose, as `upper_bound` does).
    return _edge_bound(matrix if rows <= cols else matrix.T, devices, max_partitions)


def _top_rows_bound(matrix: TopRows, devices: int) -> float:
    """A valid bound of a top-k edge without densifying it: each sender shares a device with C/L receivers
    and each receiver with R/L senders, so neither collects more than its largest kept entries."""
    rows, cols = matrix.shape
    by_row = -np.sort(-matrix.values, axis=1)[:, : cols // devices].sum()  # [R, k] rows, largest first
    col, value = matrix.indices.ravel(), matrix.values.ravel()
    order = np.lexsort((-value, col))  # by column, largest first within one
    col, value = col[order], value[order]
    starts = np.searchsorted(col, col, side="left")  # first entry of each entry's column
    rank = np.arange(len(col)) - starts  # the entry's place within its column
    by_col = value[rank < rows // devices].sum()
    return float(min(by_row, by_col, 1.0))


@dataclass(frozen=True)
class ScheduleBound:
    devices: int
    value: float
    exact: bool
    edges: dict[Pair, float]


def schedule_upper_bound(affinity: ScheduleAffinity, devices: int, *, max_partitions: int = 20000) -> ScheduleBound:
    """Σ over the schedule's edges of the best co-located fraction of that edge alone (cached)."""
    check_devices_for(affinity, devices)
    key = ("upper_bound", devices, max_partitions)
    if key not in affinity._cache:
        unit = affinity.normalised()
        per = {p: _one_edge_bound(m, devices, max_partitions) for p, m in unit.edges.items()}
        affinity._cache[key] = ScheduleBound(int(devices), float(sum(v for v, _ in per.values())),
                                             all(e for _, e in per.values()), {p: v for p, (v, _) in per.items()})
    bound: ScheduleBound = affinity._cache[key]
    return bound


@dataclass(frozen=True)
class ScheduleScoreReport:
    """J_σ of a layout with its per-edge co-located fractions.

    up_fraction / down_fraction: the chain's edges (layer i's up, layer i's down) where the schedule has
    them, None where it does not, so that a dtp:1 report reads like `ScoreReport`.
    """

    J: float
    devices: int
    random_expectation: float
    schedule: str
    edges: list[dict[str, Any]]  # {"from", "to", "name", "kind", "fraction", "upper_bound", ["kept_mass"]}
    up_fraction: list[float | None]
    down_fraction: list[float | None]
    upper_bound: float
    upper_bound_exact: bool
    layout_independent: bool

    def as_dict(self) -> dict[str, Any]:
        return {"J": self.J, "devices": self.devices, "random_expectation": self.random_expectation,
                "schedule": self.schedule, "layout_independent": self.layout_independent,
                "up_fraction": list(self.up_fraction), "down_fraction": list(self.down_fraction),
                "edges": [dict(e) for e in self.edges], "upper_bound": self.upper_bound,
                "upper_bound_exact": self.upper_bound_exact}


def schedule_score(affinity: ScheduleAffinity, kv_group_device: Any, neuron_device: Any, *,
                   devices: int | None = None, bound: ScheduleBound | None = None) -> ScheduleScoreReport:
    """J_σ of a balanced layout, its per-edge fractions, the random expectation and the upper bound."""
    heads, cells, devices = check_schedule_layout(affinity, kv_group_device, neuron_device, devices)
    unit = affinity.normalised()
    fractions = edge_fractions(unit, heads, cells)
    if bound is None:
        bound = schedule_upper_bound(affinity, devices)
    elif bound.devices != devices:
        raise ValueError(f"bound was computed for L={bound.devices} devices, the layout has L={devices}")
    kept = affinity.kept_mass()
    edges = []
    for pair, fraction in fractions.items():
        row: dict[str, Any] = {"from": pair[0], "to": pair[1], "name": edge_name(pair), "kind": edge_kind(pair),
                               "fraction": fraction, "upper_bound": bound.edges[pair]}
        if pair in kept:
            row["kept_mass"] = kept[pair]
        edges.append(row)
    n = affinity.num_layers
    masses = unit.edge_masses()
    return ScheduleScoreReport(
        J=float(sum(fractions.values())), devices=devices,
        random_expectation=float(sum(masses.values()) / devices),
        schedule=affinity.schedule, edges=edges,
        up_fraction=[fractions.get((2 * i, 2 * i + 1)) for i in range(n)],
        down_fraction=[fractions.get((2 * i + 1, 2 * i + 2)) for i in range(n - 1)],
        upper_bound=bound.value, upper_bound_exact=bound.exact,
        layout_independent=affinity.layout_independent)
