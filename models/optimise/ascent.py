"""Coordinate ascent of J_σ over the blocks of a layout: the paper's layout optimiser, for any schedule's edges.

J_σ is linear in each module's assignment given the others' (no edge joins a module to itself), so the
best balanced assignment of one layer's neurons (module 2i+1), or KV groups (module 2i), given the rest
is one transportation problem on the gain [U, L] that sums the module's incoming and outgoing edges,
which `balanced_assignment` solves exactly. Sweeps visit layer i's neurons, then its KV groups, in layer
order, so J_σ increases monotonically to a block-wise fixed point. On the paper's chain (dtp:1) a block
is ν_i given h_i and h_{i+1}, or h_i given ν_{i-1} and ν_i. On an MoE model (issue 46) each expert's
neurons are balanced on their own, and the neuron block splits exactly into one transportation problem per
expert (`blockwise_balanced_assignment`). Pure numpy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from models.base.progress import check_stop
from models.optimise.assignment import REL_TOL, blockwise_balanced_assignment
from models.optimise.bound import UpperBound
from models.optimise.edges import ScheduleAffinity, module_devices, receiver_gain, sender_gain
from models.optimise.objective import ScoreReport, check_layout, objective, score
from models.optimise.problem import (
    Problem,
    check_devices,
    contiguous_layout,
    contiguous_row,
    edges_of,
    neuron_blocks,
)


@dataclass(frozen=True, eq=False)
class OptimiseResult:
    kv_group_device: np.ndarray  # [N, G]
    neuron_device: np.ndarray  # [N, I]
    report: ScoreReport
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


def _best_block(gain: np.ndarray, current: np.ndarray, maximise: bool, blocks: int = 1) -> tuple[np.ndarray, float]:
    """The exact best balanced assignment of one block and how much it beats the current one (`blocks`: an MoE
    layer's experts, each balanced on its own: one assignment per expert)."""
    best = blockwise_balanced_assignment(gain, blocks, maximise)
    rows = np.arange(len(current))
    improvement = gain[rows, best].sum() - gain[rows, current].sum()
    return best, float(improvement if maximise else -improvement)


def _step(gain: np.ndarray, current: np.ndarray, maximise: bool, blocks: int = 1) -> np.ndarray:
    best, improvement = _best_block(gain, current, maximise, blocks)
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


def optimise(affinity: Problem, devices: int, *, maximise: bool = True, move_heads: bool = True,
             move_neurons: bool = True, layers: Any = None, max_sweeps: int = 50, tol: float = 1e-12,
             bound: UpperBound | None = None, initial_heads: np.ndarray | None = None, restarts: int = 0,
             seed: int = 0, done: Callable[[float], None] | None = None) -> OptimiseResult:
    """Coordinate ascent of J_σ over the blocks, from the contiguous layout: of objective (6) for the
    paper's chain (an `Affinity`), of the schedule's edges for a `ScheduleAffinity`.

    Each sweep visits the chosen layers in order and replaces the layer's neurons, then its KV groups,
    by the exact best balanced assignment given the rest, so J_σ never decreases (increases when
    minimising). Stops when a sweep gains no more than `tol`.
    maximise=False minimises J_σ (the anti-optimised layout); move_heads=False keeps the contiguous
    heads (neurons only); move_neurons=False keeps the contiguous neurons (heads only); layers not in
    `layers` keep the contiguous heads and neurons. `bound` reuses a precomputed upper bound.

    Coordinate ascent stops at a local optimum: with I ≫ G the first neuron step fits the neurons to
    the starting heads, after which no single head step pays. `restarts` > 0 also starts from that
    many seeded random balanced head assignments (of the moving layers) and keeps the best result;
    `initial_heads` [N, G] replaces the contiguous start. A layout-independent schedule (no edge: tp,
    ladder) returns the contiguous layout with J_σ = 0 and report.layout_independent set.

    done(fraction) is told the share of the work done after every sweep: the ascents (1 + restarts) are
    equal shares; a sweep moves its ascent's share by s/(s+1) after s sweeps (how many it takes to converge
    is not known beforehand), and the ascent's end completes it.
    """
    if restarts < 0:
        raise ValueError(f"restarts must be ≥ 0, got {restarts}")
    kwargs: dict[str, Any] = dict(maximise=maximise, move_heads=move_heads, move_neurons=move_neurons, layers=layers,
                                  max_sweeps=max_sweeps, tol=tol, bound=bound)
    single = not move_heads or edges_of(affinity).layout_independent  # every start would give the same layout
    ascents = 1 if single else 1 + restarts

    def sweeps_of(k: int) -> Callable[[int], None] | None:
        """Ascent k's share, told after each of its sweeps."""
        return None if done is None else (lambda sweeps: done((k + sweeps / (sweeps + 1)) / ascents))

    best = _ascend(affinity, devices, initial_heads=initial_heads, on_sweep=sweeps_of(0), **kwargs)
    if done is not None:
        done(1 / ascents)
    if single:
        return best
    rng = np.random.default_rng(seed)
    groups_row = contiguous_row(affinity.num_kv_groups, devices)
    sign = 1.0 if maximise else -1.0
    for k in range(1, ascents):
        start = np.stack([rng.permutation(groups_row) for _ in range(affinity.num_layers)])  # [N, G]
        candidate = _ascend(affinity, devices, initial_heads=start, on_sweep=sweeps_of(k), **kwargs)
        if sign * (candidate.report.J - best.report.J) > tol:
            best = candidate
        if done is not None:
            done((k + 1) / ascents)
    return best


def _ascend(affinity: Problem, devices: int, *, maximise: bool, move_heads: bool, move_neurons: bool,
            layers: Any, max_sweeps: int, tol: float, bound: UpperBound | None,
            initial_heads: np.ndarray | None, on_sweep: Callable[[int], None] | None = None) -> OptimiseResult:
    """One coordinate ascent from `initial_heads` (default contiguous) and contiguous neurons; on_sweep(s)
    after its s-th sweep."""
    check_devices(affinity, devices)
    if max_sweeps < 1:
        raise ValueError(f"max_sweeps must be at least 1, got {max_sweeps}")
    unit = edges_of(affinity).weighted()
    moving = _moving_layers(layers, affinity.num_layers)
    heads, cells = contiguous_layout(affinity, devices)
    if initial_heads is not None:
        heads[moving] = np.asarray(initial_heads)[moving]
    sign = 1.0 if maximise else -1.0
    previous = objective(unit, heads, cells)
    history: list[float] = []
    for _ in range(0 if unit.layout_independent else max_sweeps):
        for i in moving:
            check_stop()  # a safe point per layer: a stopped job's optimiser ends here (models.base.progress)
            if move_neurons:
                cells[i] = _step(module_gain(unit, heads, cells, 2 * i + 1, devices), cells[i], maximise,
                                 neuron_blocks(affinity))
            if move_heads:
                heads[i] = _step(module_gain(unit, heads, cells, 2 * i, devices), heads[i], maximise)
        history.append(objective(unit, heads, cells))
        if on_sweep is not None:
            on_sweep(len(history))
        if sign * (history[-1] - previous) <= tol:
            break
        previous = history[-1]
    report = score(affinity, heads, cells, devices=devices, bound=bound)
    heads.setflags(write=False)
    cells.setflags(write=False)
    return OptimiseResult(heads, cells, report, len(history), history)


def block_improvement(affinity: Problem, kv_group_device: Any, neuron_device: Any, *, devices: int | None = None,
                      maximise: bool = True, move_heads: bool = True, move_neurons: bool = True,
                      layers: Any = None) -> float:
    """Largest gain in J_σ (decrease when minimising) that one exact block step of the optimiser could make.

    Zero (up to rounding) at a fixed point of `optimise` with the same options.
    """
    heads, cells, devices = check_layout(affinity, kv_group_device, neuron_device, devices)
    unit = edges_of(affinity).weighted()
    best = 0.0
    for i in _moving_layers(layers, affinity.num_layers):
        if move_neurons:
            best = max(best, _best_block(module_gain(unit, heads, cells, 2 * i + 1, devices), cells[i], maximise,
                                         neuron_blocks(affinity))[1])
        if move_heads:
            best = max(best, _best_block(module_gain(unit, heads, cells, 2 * i, devices), heads[i], maximise)[1])
    return best


def is_block_optimal(affinity: Problem, kv_group_device: Any, neuron_device: Any, *, devices: int | None = None,
                     maximise: bool = True, move_heads: bool = True, move_neurons: bool = True,
                     layers: Any = None, atol: float = 1e-9) -> bool:
    """True when no single block step (neurons of a layer, or KV groups of a layer) improves J_σ by > atol."""
    return block_improvement(affinity, kv_group_device, neuron_device, devices=devices, maximise=maximise,
                             move_heads=move_heads, move_neurons=move_neurons, layers=layers) <= atol
