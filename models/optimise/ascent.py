"""Coordinate ascent of J over the chain of blocks: the paper's layout optimiser.

Every block of the chain (ν_i given h_i and h_{i+1}; h_i given ν_{i-1} and ν_i) is a linear
assignment with equal device capacities, which `balanced_assignment` solves exactly, so coordinate
ascent over the blocks increases J monotonically to a block-wise fixed point. Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from models.optimise.assignment import REL_TOL, balanced_assignment
from models.optimise.bound import UpperBound
from models.optimise.objective import ScoreReport, check_layout, objective, score
from models.optimise.problem import Affinity, check_devices, contiguous_layout, contiguous_row


@dataclass(frozen=True, eq=False)
class OptimiseResult:
    kv_group_device: np.ndarray  # [N, G]
    neuron_device: np.ndarray  # [N, I]
    report: ScoreReport
    sweeps: int
    history: list[float]  # J after each sweep


def _one_hot(assign: np.ndarray, devices: int) -> np.ndarray:
    return (assign[:, None] == np.arange(devices)).astype(np.float64)  # [n, L]


def _neuron_gain(unit: Affinity, heads: np.ndarray, layer: int, devices: int) -> np.ndarray:
    """Mass neuron k of `layer` shares with device l's KV groups of this layer and the next: [I, L]."""
    gain = unit.up[layer].T @ _one_hot(heads[layer], devices)
    if layer + 1 < unit.num_layers:
        gain += unit.down[layer] @ _one_hot(heads[layer + 1], devices)
    return gain


def _head_gain(unit: Affinity, cells: np.ndarray, layer: int, devices: int) -> np.ndarray:
    """Mass KV group g of `layer` shares with device l's neurons of this layer and the previous: [G, L]."""
    gain = unit.up[layer] @ _one_hot(cells[layer], devices)
    if layer > 0:
        gain += unit.down[layer - 1].T @ _one_hot(cells[layer - 1], devices)
    return gain


def _best_block(gain: np.ndarray, current: np.ndarray, maximise: bool) -> tuple[np.ndarray, float]:
    """The exact best balanced assignment of one block and how much it beats the current one."""
    best = balanced_assignment(gain, maximise)
    rows = np.arange(len(current))
    improvement = gain[rows, best].sum() - gain[rows, current].sum()
    return best, float(improvement if maximise else -improvement)


def _step(gain: np.ndarray, current: np.ndarray, maximise: bool) -> np.ndarray:
    best, improvement = _best_block(gain, current, maximise)
    # Keep the current assignment on (near-)ties so that sweeps do not churn between equal optima.
    return best if improvement > REL_TOL * max(float(gain.sum()), 1.0) else current


def _moving_layers(layers: Any, num_layers: int) -> list[int]:
    if layers is None:
        return list(range(num_layers))
    chosen = sorted({int(i) for i in layers})
    outside = [i for i in chosen if not 0 <= i < num_layers]
    if outside:
        raise ValueError(f"layers: {outside} out of range for N={num_layers} layers (valid 0..{num_layers - 1})")
    return chosen


def optimise(affinity: Affinity, devices: int, *, maximise: bool = True, move_heads: bool = True,
             move_neurons: bool = True, layers: Any = None, max_sweeps: int = 50, tol: float = 1e-12,
             bound: UpperBound | None = None, initial_heads: np.ndarray | None = None, restarts: int = 0,
             seed: int = 0) -> OptimiseResult:
    """Coordinate ascent of J over the chain's blocks, from the contiguous layout.

    Each sweep visits the chosen layers in order and replaces the layer's neurons, then its KV groups,
    by the exact best balanced assignment given the neighbouring blocks, so J never decreases
    (increases when minimising). Stops when a sweep gains no more than `tol`.
    maximise=False minimises J (the anti-optimised layout); move_heads=False keeps the contiguous
    heads (neurons only); move_neurons=False keeps the contiguous neurons (heads only); layers not in
    `layers` keep the contiguous heads and neurons. `bound` reuses a precomputed upper bound.

    Coordinate ascent stops at a local optimum: with I ≫ G the first neuron step fits the neurons to
    the starting heads, after which no single head step pays. `restarts` > 0 also starts from that
    many seeded random balanced head assignments (of the moving layers) and keeps the best result;
    `initial_heads` [N, G] replaces the contiguous start.
    """
    if restarts < 0:
        raise ValueError(f"restarts must be ≥ 0, got {restarts}")
    kwargs: dict[str, Any] = dict(maximise=maximise, move_heads=move_heads, move_neurons=move_neurons, layers=layers,
                  max_sweeps=max_sweeps, tol=tol, bound=bound)
    best = _ascend(affinity, devices, initial_heads=initial_heads, **kwargs)
    if not move_heads:
        return best  # every start would be the same contiguous heads
    return best_of_restarts(best, lambda start: _ascend(affinity, devices, initial_heads=start, **kwargs),
                            num_kv_groups=affinity.num_kv_groups, num_layers=affinity.num_layers, devices=devices,
                            restarts=restarts, seed=seed, maximise=maximise, tol=tol)


def best_of_restarts(best: Any, ascend: Any, *, num_kv_groups: int, num_layers: int, devices: int, restarts: int,
                     seed: int, maximise: bool, tol: float) -> Any:
    """`best` or a better result of `ascend(start)` from `restarts` seeded random balanced head starts
    [N, G] (the same seeded starts for every objective: chain or schedule); better by more than `tol`
    in report.J."""
    rng = np.random.default_rng(seed)
    groups_row = contiguous_row(num_kv_groups, devices)
    sign = 1.0 if maximise else -1.0
    for _ in range(restarts):
        start = np.stack([rng.permutation(groups_row) for _ in range(num_layers)])
        candidate = ascend(start)
        if sign * (candidate.report.J - best.report.J) > tol:
            best = candidate
    return best


def _ascend(affinity: Affinity, devices: int, *, maximise: bool, move_heads: bool, move_neurons: bool,
            layers: Any, max_sweeps: int, tol: float, bound: UpperBound | None,
            initial_heads: np.ndarray | None) -> OptimiseResult:
    """One coordinate ascent from `initial_heads` (default contiguous) and contiguous neurons."""
    check_devices(affinity, devices)
    if max_sweeps < 1:
        raise ValueError(f"max_sweeps must be at least 1, got {max_sweeps}")
    unit = affinity.normalised()
    moving = _moving_layers(layers, affinity.num_layers)
    heads, cells = contiguous_layout(affinity, devices)
    if initial_heads is not None:
        heads[moving] = np.asarray(initial_heads)[moving]
    sign = 1.0 if maximise else -1.0
    previous = objective(unit, heads, cells)
    history: list[float] = []
    for _ in range(max_sweeps):
        for i in moving:
            if move_neurons:
                cells[i] = _step(_neuron_gain(unit, heads, i, devices), cells[i], maximise)
            if move_heads:
                heads[i] = _step(_head_gain(unit, cells, i, devices), heads[i], maximise)
        history.append(objective(unit, heads, cells))
        if sign * (history[-1] - previous) <= tol:
            break
        previous = history[-1]
    report = score(affinity, heads, cells, devices=devices, bound=bound)
    heads.setflags(write=False)
    cells.setflags(write=False)
    return OptimiseResult(heads, cells, report, len(history), history)


def block_improvement(affinity: Affinity, kv_group_device: Any, neuron_device: Any, *, devices: int | None = None,
                      maximise: bool = True, move_heads: bool = True, move_neurons: bool = True,
                      layers: Any = None) -> float:
    """Largest gain in J (decrease when minimising) that one exact block step of the optimiser could make.

    Zero (up to rounding) at a fixed point of `optimise` with the same options.
    """
    heads, cells, devices = check_layout(affinity, kv_group_device, neuron_device, devices)
    unit = affinity.normalised()
    best = 0.0
    for i in _moving_layers(layers, affinity.num_layers):
        if move_neurons:
            best = max(best, _best_block(_neuron_gain(unit, heads, i, devices), cells[i], maximise)[1])
        if move_heads:
            best = max(best, _best_block(_head_gain(unit, cells, i, devices), heads[i], maximise)[1])
    return best


def is_block_optimal(affinity: Affinity, kv_group_device: Any, neuron_device: Any, *, devices: int | None = None,
                     maximise: bool = True, move_heads: bool = True, move_neurons: bool = True,
                     layers: Any = None, atol: float = 1e-9) -> bool:
    """True when no single block step (neurons of a layer, or KV groups of a layer) improves J by > atol."""
    return block_improvement(affinity, kv_group_device, neuron_device, devices=devices, maximise=maximise,
                             move_heads=move_heads, move_neurons=move_neurons, layers=layers) <= atol
