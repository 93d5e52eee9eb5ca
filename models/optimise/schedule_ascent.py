"""Coordinate ascent of J_σ (issue 20): the paper's optimiser for any schedule's edges.

J_σ is linear in each module's assignment given the others' (no edge joins a module to itself), so the
best balanced assignment of one layer's neurons (module 2i+1), or KV groups (module 2i), given the rest
is one transportation problem on the gain [U, L] that sums the module's incoming and outgoing edges,
which `balanced_assignment` solves exactly. Sweeps visit layer i's neurons, then its KV groups, in
layer order (the order of `models.optimise.ascent`, so that at dtp:1, whose edges are the chain's, it
returns the same layouts), until a sweep gains no more than `tol`; `restarts` as there. Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from models.optimise.ascent import _moving_layers, _step, best_of_restarts
from models.optimise.assignment import balanced_assignment
from models.optimise.edges import ScheduleAffinity, module_devices, receiver_gain, sender_gain
from models.optimise.schedule_objective import (
    ScheduleBound,
    ScheduleScoreReport,
    check_devices_for,
    check_schedule_layout,
    contiguous_schedule_layout,
    schedule_objective,
    schedule_score,
)


@dataclass(frozen=True, eq=False)
class ScheduleOptimiseResult:
    kv_group_device: np.ndarray  # [N, G]
    neuron_device: np.ndarray  # [N, I]
    report: ScheduleScoreReport
    sweeps: int
    history: list[float]  # J_σ after each sweep


def module_gain(unit: ScheduleAffinity, heads: np.ndarray, cells: np.ndarray, n: int, devices: int) -> np.ndarray:
    """[U_n, L]: the mass each unit of module n shares with device l's units of every module it is joined
    to (incoming edges m → n, then outgoing n → t)."""
    gain = np.zeros((unit.units(n), devices))
    for pair in unit.incoming(n):
        gain += receiver_gain(unit.edges[pair], module_devices(heads, cells, pair[0]), devices)
    for pair in unit.outgoing(n):
        gain += sender_gain(unit.edges[pair], module_devices(heads, cells, pair[1]), devices)
    return gain


def optimise_schedule(affinity: ScheduleAffinity, devices: int, *, maximise: bool = True, move_heads: bool = True,
                      move_neurons: bool = True, layers: Any = None, max_sweeps: int = 50, tol: float = 1e-12,
                      bound: ScheduleBound | None = None, initial_heads: np.ndarray | None = None,
                      restarts: int = 0, seed: int = 0) -> ScheduleOptimiseResult:
    """Coordinate ascent of J_σ from the contiguous layout (plus `restarts` seeded random head starts).

    The options mean what they mean in `models.optimise.optimise`. A layout-independent schedule (no
    edge: tp, ladder) returns the contiguous layout with J_σ = 0 and report.layout_independent set.
    """
    if restarts < 0:
        raise ValueError(f"restarts must be ≥ 0, got {restarts}")
    kwargs: dict[str, Any] = dict(maximise=maximise, move_heads=move_heads, move_neurons=move_neurons,
                                  layers=layers, max_sweeps=max_sweeps, tol=tol, bound=bound)
    best = _ascend(affinity, devices, initial_heads=initial_heads, **kwargs)
    if not move_heads or affinity.layout_independent:
        return best
    result: ScheduleOptimiseResult = best_of_restarts(
        best, lambda start: _ascend(affinity, devices, initial_heads=start, **kwargs),
        num_kv_groups=affinity.num_kv_groups, num_layers=affinity.num_layers, devices=devices, restarts=restarts,
        seed=seed, maximise=maximise, tol=tol)
    return result


def _ascend(affinity: ScheduleAffinity, devices: int, *, maximise: bool, move_heads: bool, move_neurons: bool,
            layers: Any, max_sweeps: int, tol: float, bound: ScheduleBound | None,
            initial_heads: np.ndarray | None) -> ScheduleOptimiseResult:
    check_devices_for(affinity, devices)
    if max_sweeps < 1:
        raise ValueError(f"max_sweeps must be at least 1, got {max_sweeps}")
    unit = affinity.normalised()
    moving = _moving_layers(layers, affinity.num_layers)
    heads, cells = contiguous_schedule_layout(affinity, devices)
    if initial_heads is not None:
        heads[moving] = np.asarray(initial_heads)[moving]
    sign = 1.0 if maximise else -1.0
    previous = schedule_objective(unit, heads, cells)
    history: list[float] = []
    if not affinity.layout_independent:
        for _ in range(max_sweeps):
            for i in moving:
                if move_neurons:
                    cells[i] = _step(module_gain(unit, heads, cells, 2 * i + 1, devices), cells[i], maximise)
                if move_heads:
                    heads[i] = _step(module_gain(unit, heads, cells, 2 * i, devices), heads[i], maximise)
            history.append(schedule_objective(unit, heads, cells))
            if sign * (history[-1] - previous) <= tol:
                break
            previous = history[-1]
    report = schedule_score(affinity, heads, cells, devices=devices, bound=bound)
    heads.setflags(write=False)
    cells.setflags(write=False)
    return ScheduleOptimiseResult(heads, cells, report, len(history), history)


def schedule_block_improvement(affinity: ScheduleAffinity, kv_group_device: Any, neuron_device: Any, *,
                               devices: int | None = None, maximise: bool = True) -> float:
    """Largest gain in J_σ one exact block step (a layer's neurons or KV groups) could make; 0 at a fixed point."""
    heads, cells, devices = check_schedule_layout(affinity, kv_group_device, neuron_device, devices)
    unit = affinity.normalised()
    best = 0.0
    for n in range(2 * affinity.num_layers):
        gain = module_gain(unit, heads, cells, n, devices)
        current = module_devices(heads, cells, n)
        rows = np.arange(len(current))
        choice = balanced_assignment(gain, maximise)
        improvement = gain[rows, choice].sum() - gain[rows, current].sum()
        best = max(best, float(improvement if maximise else -improvement))
    return best
