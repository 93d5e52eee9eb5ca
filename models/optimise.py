"""Affinity objective (6) of the paper, its per-edge upper bound, and the chain optimiser.

A layout puts KV group g of layer i on device h_i(g) and FFN neuron k on device ν_i(k), balanced
(G/L groups and I/L neurons per device). The objective is the total co-located normalised affinity

    J = Σ_i Σ_{g,k: h_i(g)=ν_i(k)} Ŝup_i[g, k] + Σ_{i<N-1} Σ_{k,g: ν_i(k)=h_{i+1}(g)} Ŝdown_i[k, g],

in [0, 2N-1]. Every block of the chain (ν_i given h_i and h_{i+1}; h_i given ν_{i-1} and ν_i) is a
linear assignment with equal device capacities, which `balanced_assignment` solves exactly, so
coordinate ascent over the blocks increases J monotonically to a block-wise fixed point.

Pure numpy.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

# Relative tolerance for "strictly better" in the assignment solver: far above float64 rounding of
# sums of a few gains, far below any difference that matters.
_REL_TOL = 1e-12
_MAX_PRICE_SWEEPS = 30
_GAIN_CHUNK = 1 << 22  # floats per temporary when scoring group partitions in bulk


# --------------------------------------------------------------------------- balanced assignment


def _check_gain(gain: np.ndarray) -> np.ndarray:
    gain = np.asarray(gain, dtype=np.float64)
    if gain.ndim != 2:
        raise ValueError(f"gain must be a 2-D [units, devices] array, got shape {list(gain.shape)}")
    n, devices = gain.shape
    if devices < 1:
        raise ValueError("gain must have at least one device column")
    if n % devices:
        raise ValueError(
            f"cannot balance {n} units over {devices} devices: the number of units must be a multiple "
            f"of the number of devices"
        )
    if np.isnan(gain).any():
        raise ValueError("gain contains NaN")
    if not np.isfinite(gain).all():
        raise ValueError("gain contains ±inf; gains must be finite")
    return gain


def _clearing_prices(value: np.ndarray, capacity: int, tol: float) -> np.ndarray:
    """Device prices p [L] under which each unit's favourite device (argmax of value - p) is nearly balanced.

    Coordinate descent on the dual Σ_u max_l (value[u,l] - p_l) + capacity Σ_l p_l: each step sets one
    price so that exactly `capacity` units prefer that device, the others held fixed. It only needs to
    land close to balance; the exact repair afterwards makes the result optimal whatever it returns.
    """
    n, devices = value.shape
    prices = np.zeros(devices)
    lo, hi = n - capacity - 1, n - capacity
    for _ in range(_MAX_PRICE_SWEEPS):
        previous = prices.copy()
        for l in range(devices):
            reduced = value - prices  # [n, L]
            reduced[:, l] = -np.inf
            margin = value[:, l] - reduced.max(axis=1)  # [n] highest price at which u still prefers l
            kth = np.partition(margin, (lo, hi))
            prices[l] = 0.5 * (kth[lo] + kth[hi])
        counts = np.bincount(np.argmax(value - prices, axis=1), minlength=devices)
        # Stalled prices mean ties (or a kink of the dual) that only the exact repair can resolve.
        if (counts == capacity).all() or np.abs(prices - previous).max() <= tol:
            break
    return prices


def _device_edges(value: np.ndarray, assign: np.ndarray, devices: int) -> tuple[np.ndarray, np.ndarray]:
    """Cheapest single-unit move between each pair of devices.

    Returns loss [L, L] (loss[a, b] = min over units u on a of value[u,a] - value[u,b]; inf when a is
    empty or a == b) and the per-unit loss of moving to each device [n, L].
    """
    n = value.shape[0]
    own = value[np.arange(n), assign]  # [n]
    unit_loss = own[:, None] - value  # [n, L]
    order = np.argsort(assign, kind="stable")
    counts = np.bincount(assign, minlength=devices)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    loss = np.full((devices, devices), np.inf)
    present = counts > 0
    loss[present] = np.minimum.reduceat(unit_loss[order], starts[present], axis=0)
    np.fill_diagonal(loss, np.inf)
    return loss, unit_loss


def _shortest_paths(loss: np.ndarray, sources: np.ndarray, tol: float) -> tuple[np.ndarray, np.ndarray]:
    """Bellman-Ford on the L-node device graph from a set of sources: distances [L], predecessors [L]."""
    devices = loss.shape[0]
    dist = np.where(sources, 0.0, np.inf)
    pred = np.full(devices, -1)
    for _ in range(devices - 1):
        via = dist[:, None] + loss  # [L, L] reach b through a
        best_from = via.argmin(axis=0)  # [L]
        best = via[best_from, np.arange(devices)]
        better = best < dist - tol
        if not better.any():
            break
        dist = np.where(better, best, dist)
        pred = np.where(better, best_from, pred)
    return dist, pred


def _trace(pred: np.ndarray, end: int) -> list[int]:
    path = [end]
    while pred[path[-1]] >= 0:
        path.append(int(pred[path[-1]]))
        if len(path) > len(pred):
            raise RuntimeError("balanced_assignment: negative cycle in the device graph (numerical trouble)")
    return path[::-1]


def _move_along(assign: np.ndarray, unit_loss: np.ndarray, loss: np.ndarray, path: list[int], limit: int) -> None:
    """Move up to `limit` units along every edge of `path`, using only units whose loss ties the cheapest.

    Tied units all cost the same, so moving k of them equals k successive shortest-path steps.
    """
    movers = []
    for a, b in itertools.pairwise(path):
        tied = np.flatnonzero((assign == a) & (unit_loss[:, b] == loss[a, b]))
        movers.append((tied, b))
        limit = min(limit, tied.size)
    for tied, b in movers:
        assign[tied[:limit]] = b


def _augment_to_balance(value: np.ndarray, assign: np.ndarray, capacity: int, tol: float) -> None:
    """Successive shortest paths on the device graph from over-full to under-full devices, in place.

    Starting from an assignment that is optimal for its own device counts, moving a unit along a
    shortest path keeps it optimal for the new counts, so the balanced end point is optimal.
    """
    devices = value.shape[1]
    while True:
        counts = np.bincount(assign, minlength=devices)
        excess = counts - capacity  # [L]
        if not excess.any():
            return
        loss, unit_loss = _device_edges(value, assign, devices)
        dist, pred = _shortest_paths(loss, excess > 0, tol)
        short = np.where(excess < 0, dist, np.inf)
        target = int(np.argmin(short))
        path = _trace(pred, target)
        _move_along(assign, unit_loss, loss, path, min(int(excess[path[0]]), int(-excess[target])))


def _negative_cycle(loss: np.ndarray, tol: float) -> list[int] | None:
    """A device cycle whose moves gain more than tol in total, or None (the optimality certificate)."""
    devices = loss.shape[0]
    dist = np.zeros(devices)
    pred = np.full(devices, -1)
    for _ in range(devices):
        via = dist[:, None] + loss  # [L, L]
        best_from = via.argmin(axis=0)
        best = via[best_from, np.arange(devices)]
        better = best < dist - tol
        if not better.any():
            return None
        dist = np.where(better, best, dist)
        pred = np.where(better, best_from, pred)
    # Still relaxing after L rounds: a node relaxed in round L has a predecessor chain of L + 1 nodes,
    # so walking back L steps lands on a cycle of the predecessor graph.
    node = int(np.flatnonzero(better)[0])
    for _ in range(devices):
        node = int(pred[node])
    cycle = [node]
    while (prev := int(pred[cycle[-1]])) != node:
        cycle.append(prev)
    cycle = [node, *cycle[::-1]]  # forward order, closed: node -> ... -> node
    weight = sum(loss[a, b] for a, b in itertools.pairwise(cycle))
    return cycle if weight < -tol else None


def _cancel_negative_cycles(value: np.ndarray, assign: np.ndarray, tol: float) -> None:
    """Rounding can leave a balanced assignment a hair from optimal; move units round improving cycles."""
    devices = value.shape[1]
    while True:
        loss, unit_loss = _device_edges(value, assign, devices)
        cycle = _negative_cycle(loss, tol)
        if cycle is None:
            return
        _move_along(assign, unit_loss, loss, cycle, 1)


def balanced_assignment(gain: np.ndarray, maximise: bool = True) -> np.ndarray:
    """Exact optimal assignment of n units to L devices with n/L units on every device.

    gain: [n, L]; returns a [n] int64 array a maximising (or minimising) Σ_u gain[u, a[u]].
    Deterministic. Optimality is certified by the absence of an improving cycle of single-unit moves
    between devices (the min-cost-flow optimality condition), up to a relative tolerance of 1e-12.
    """
    gain = _check_gain(gain)
    n, devices = gain.shape
    if n == 0 or devices == 1:
        return np.zeros(n, dtype=np.int64)
    value = gain if maximise else -gain
    capacity = n // devices
    tol = _REL_TOL * float(np.abs(value).max())
    prices = _clearing_prices(value, capacity, tol)
    assign = np.argmax(value - prices, axis=1).astype(np.int64)  # optimal for its own device counts
    _augment_to_balance(value, assign, capacity, tol)
    _cancel_negative_cycles(value, assign, tol)
    return assign


# --------------------------------------------------------------------------- affinities


def _unit_mass(matrix: np.ndarray) -> np.ndarray:
    total = matrix.sum()
    # An all-zero edge stays zero: it carries no affinity to co-locate.
    return matrix / total if total > 0 else matrix.copy()


def _frozen_float(matrix: Any) -> np.ndarray:
    arr = np.array(matrix, dtype=np.float64)
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class Affinity:
    """Per-layer affinities of a model with N layers, G KV groups and I FFN neurons per layer.

    up[i]: [G, I], how much neuron k of layer i depends on KV group g of layer i (i = 0..N-1).
    down[i]: [I, G], how much KV group g of layer i+1 depends on neuron k of layer i (i = 0..N-2).
    Non-negative and finite; stored as read-only float64 copies.
    """

    up: list[np.ndarray]
    down: list[np.ndarray]
    _cache: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "up", [_frozen_float(m) for m in self.up])
        object.__setattr__(self, "down", [_frozen_float(m) for m in self.down])
        _validate_affinity(self.up, self.down)

    @property
    def num_layers(self) -> int:
        return len(self.up)

    @property
    def num_kv_groups(self) -> int:
        return int(self.up[0].shape[0])

    @property
    def intermediate_size(self) -> int:
        return int(self.up[0].shape[1])

    def normalised(self) -> Affinity:
        """Copy with every matrix scaled to unit mass (all-zero matrices stay zero); cached."""
        if "normalised" not in self._cache:
            unit = Affinity([_unit_mass(m) for m in self.up], [_unit_mass(m) for m in self.down])
            unit._cache["normalised"] = unit
            self._cache["normalised"] = unit
        result: Affinity = self._cache["normalised"]
        return result

    def edge_masses(self) -> np.ndarray:
        """Total mass of each edge, up edges then down edges: [2N-1]."""
        return np.array([m.sum() for m in [*self.up, *self.down]])


def _check_matrix(matrix: np.ndarray, name: str, shape: tuple[int, int], like: str) -> None:
    if matrix.shape != shape:
        raise ValueError(f"{name}: expected shape {list(shape)} ({like}), got {list(matrix.shape)}")
    if not np.isfinite(matrix).all():
        raise ValueError(f"{name}: contains NaN or inf")
    if matrix.size and matrix.min() < 0:
        raise ValueError(f"{name}: affinities must be non-negative, found {matrix.min():.3g}")


def _validate_affinity(up: list[np.ndarray], down: list[np.ndarray]) -> None:
    if not up:
        raise ValueError("up: need at least one layer")
    if up[0].ndim != 2 or 0 in up[0].shape:
        raise ValueError(f"up[0]: expected a non-empty 2-D [G, I] matrix, got shape {list(up[0].shape)}")
    groups, neurons = up[0].shape
    if len(down) != len(up) - 1:
        raise ValueError(f"down: expected N-1={len(up) - 1} matrices for N={len(up)} layers, got {len(down)}")
    for i, matrix in enumerate(up):
        _check_matrix(matrix, f"up[{i}]", (groups, neurons), "[G, I] like up[0]")
    for i, matrix in enumerate(down):
        _check_matrix(matrix, f"down[{i}]", (neurons, groups), "[I, G] with G, I of up[0]")


# --------------------------------------------------------------------------- layouts and the score


def valid_device_counts(groups: int, neurons: int) -> list[int]:
    return [d for d in range(1, groups + 1) if groups % d == 0 and neurons % d == 0]


def check_devices(affinity: Affinity, devices: int) -> None:
    """Raise ValueError unless `devices` divides both the KV groups and the FFN width."""
    groups, neurons = affinity.num_kv_groups, affinity.intermediate_size
    if not isinstance(devices, int | np.integer) or devices < 1:
        raise ValueError(f"devices must be a positive integer, got {devices!r}")
    bad = [f"{name}={size}" for name, size in (("num_kv_groups", groups), ("intermediate_size", neurons))
           if size % devices]
    if bad:
        valid = ", ".join(map(str, valid_device_counts(groups, neurons)))
        raise ValueError(f"devices L={devices} does not divide {' and '.join(bad)}; valid L: {valid}")


def contiguous_row(width: int, devices: int) -> np.ndarray:
    """Storage order sliced into L shards: unit u on device u // (width / L). [width]"""
    return np.repeat(np.arange(devices), width // devices)


def _check_layout(affinity: Affinity, kv_group_device: Any, neuron_device: Any,
                  devices: int | None) -> tuple[np.ndarray, np.ndarray, int]:
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


@dataclass(frozen=True)
class UpperBound:
    """Σ over edges of the best co-located fraction of that edge alone; `exact` when every term is exact."""

    devices: int
    value: float
    exact: bool
    up: list[float]
    down: list[float]


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
    heads, cells, devices = _check_layout(affinity, kv_group_device, neuron_device, devices)
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


# --------------------------------------------------------------------------- upper bound


def partition_count(groups: int, devices: int) -> int:
    """Balanced partitions of `groups` items into `devices` unlabelled blocks: G! / ((G/L)!^L L!)."""
    size = groups // devices
    return math.factorial(groups) // (math.factorial(size) ** devices * math.factorial(devices))


@lru_cache(maxsize=16)
def _unlabelled_partitions(groups: int, devices: int) -> tuple[np.ndarray, np.ndarray]:
    """Every balanced partition of the groups once, up to relabelling of its blocks.

    Returns blocks [B, G/L] (every G/L-subset of the groups, as sorted member lists) and partitions
    [P, L] (the block ids of each partition). The lowest free group always opens the next block,
    which fixes the order of the blocks and so counts each partition once.
    """
    size = groups // devices
    subsets = list(itertools.combinations(range(groups), size))
    block_id = {members: j for j, members in enumerate(subsets)}
    found: list[list[int]] = []

    def fill(free: tuple[int, ...], chosen: list[int]) -> None:
        if not free:
            found.append(list(chosen))
            return
        first, rest = free[0], free[1:]
        for others in itertools.combinations(rest, size - 1):
            chosen.append(block_id[(first, *others)])
            fill(tuple(g for g in rest if g not in others), chosen)
            chosen.pop()

    fill(tuple(range(groups)), [])
    blocks = np.array(subsets, dtype=np.int64).reshape(len(subsets), size)
    partitions = np.array(found, dtype=np.int64)
    blocks.setflags(write=False)
    partitions.setflags(write=False)
    return blocks, partitions


def _edge_bound_relaxed(matrix: np.ndarray, devices: int) -> float:
    """A valid bound without enumeration: a neuron shares a device with exactly G/L groups, and a group
    with exactly I/L neurons, so neither can collect more than its top G/L (resp. I/L) entries."""
    groups, neurons = matrix.shape
    per_neuron = np.sort(matrix, axis=0)[groups - groups // devices:].sum()
    per_group = np.sort(matrix, axis=1)[:, neurons - neurons // devices:].sum()
    return float(min(per_neuron, per_group))


def _relaxed_partition_values(matrix: np.ndarray, blocks: np.ndarray, partitions: np.ndarray) -> np.ndarray:
    """Σ_k max over the partition's blocks of the mass neuron k shares with the block: [P].

    The value of the partition if neurons ignored balance, so an upper bound of its exact value.
    Separable over neurons, so computed in neuron chunks to bound the [B, w] and [P, w] temporaries.
    """
    neurons = matrix.shape[1]
    width = max(1, _GAIN_CHUNK // max(len(blocks), len(partitions)))
    relaxed = np.zeros(len(partitions))
    for start in range(0, neurons, width):
        block_mass = matrix[:, start:start + width][blocks].sum(axis=1)  # [B, w]
        best = block_mass[partitions[:, 0]]  # [P, w]
        for j in range(1, partitions.shape[1]):
            np.maximum(best, block_mass[partitions[:, j]], out=best)
        relaxed += best.sum(axis=1)
    return relaxed


def _edge_bound_exact(matrix: np.ndarray, devices: int) -> float:
    """max over balanced (group partition, neuron assignment) of the co-located mass of one [G, I] edge.

    Branch and bound over the group partitions: solve partitions exactly in decreasing order of their
    relaxed value (neurons ignoring balance) until the best exact value reaches the next relaxed one.
    """
    groups, neurons = matrix.shape
    blocks, partitions = _unlabelled_partitions(groups, devices)  # [B, G/L], [P, L]
    relaxed = _relaxed_partition_values(matrix, blocks, partitions)  # [P]
    slack = _REL_TOL * float(relaxed.max())
    best = -np.inf
    for p in np.argsort(-relaxed, kind="stable"):
        if best >= relaxed[p] - slack:
            break
        gain = matrix[blocks[partitions[p]]].sum(axis=1).T  # [I, L]
        assign = balanced_assignment(gain)
        best = max(best, float(gain[np.arange(neurons), assign].sum()))
    return best


def _edge_bound(matrix: np.ndarray, devices: int, max_partitions: int) -> tuple[float, bool]:
    """Bound for one normalised edge as [G, I] (a down edge transposed); (value, exact)."""
    if not matrix.any():
        return 0.0, True
    if devices == 1:
        return float(matrix.sum()), True
    if partition_count(matrix.shape[0], devices) > max_partitions:
        return _edge_bound_relaxed(matrix, devices), False
    return _edge_bound_exact(matrix, devices), True


def upper_bound(affinity: Affinity, devices: int, *, max_partitions: int = 20000) -> UpperBound:
    """Σ over edges of the best co-located fraction of that edge optimised alone (cached per affinity).

    No layout can beat it, since J is the sum of the edges' fractions. Exact where the group partitions
    number at most `max_partitions`, otherwise a looser valid bound with exact=False.
    """
    check_devices(affinity, devices)
    key = ("upper_bound", devices, max_partitions)
    if key not in affinity._cache:
        unit = affinity.normalised()
        up = [_edge_bound(m, devices, max_partitions) for m in unit.up]
        down = [_edge_bound(m.T, devices, max_partitions) for m in unit.down]
        affinity._cache[key] = UpperBound(
            devices=int(devices),
            value=float(sum(v for v, _ in up) + sum(v for v, _ in down)),
            exact=all(e for _, e in up) and all(e for _, e in down),
            up=[v for v, _ in up],
            down=[v for v, _ in down],
        )
    result: UpperBound = affinity._cache[key]
    return result


# --------------------------------------------------------------------------- chain optimiser


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
    return best if improvement > _REL_TOL * max(float(gain.sum()), 1.0) else current


def _moving_layers(layers: Any, num_layers: int) -> list[int]:
    if layers is None:
        return list(range(num_layers))
    chosen = sorted({int(i) for i in layers})
    outside = [i for i in chosen if not 0 <= i < num_layers]
    if outside:
        raise ValueError(f"layers: {outside} out of range for N={num_layers} layers (valid 0..{num_layers - 1})")
    return chosen


def _contiguous_layout(affinity: Affinity, devices: int) -> tuple[np.ndarray, np.ndarray]:
    n = affinity.num_layers
    heads = np.tile(contiguous_row(affinity.num_kv_groups, devices), (n, 1))  # [N, G]
    cells = np.tile(contiguous_row(affinity.intermediate_size, devices), (n, 1))  # [N, I]
    return heads, cells


def _objective(unit: Affinity, heads: np.ndarray, cells: np.ndarray) -> float:
    up_fraction, down_fraction = _co_located(unit, heads, cells)
    return float(up_fraction.sum() + down_fraction.sum())


def contiguous_layout(affinity: Affinity, devices: int) -> tuple[np.ndarray, np.ndarray]:
    """The storage-order layout as arrays: kv_group_device [N, G], neuron_device [N, I]."""
    check_devices(affinity, devices)
    return _contiguous_layout(affinity, devices)


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
    rng = np.random.default_rng(seed)
    groups_row = contiguous_row(affinity.num_kv_groups, devices)
    sign = 1.0 if maximise else -1.0
    for _ in range(restarts):
        start = np.stack([rng.permutation(groups_row) for _ in range(affinity.num_layers)])
        candidate = _ascend(affinity, devices, initial_heads=start, **kwargs)
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
    heads, cells = _contiguous_layout(affinity, devices)
    if initial_heads is not None:
        heads[moving] = np.asarray(initial_heads)[moving]
    sign = 1.0 if maximise else -1.0
    previous = _objective(unit, heads, cells)
    history: list[float] = []
    for _ in range(max_sweeps):
        for i in moving:
            if move_neurons:
                cells[i] = _step(_neuron_gain(unit, heads, i, devices), cells[i], maximise)
            if move_heads:
                heads[i] = _step(_head_gain(unit, cells, i, devices), heads[i], maximise)
        history.append(_objective(unit, heads, cells))
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
    heads, cells, devices = _check_layout(affinity, kv_group_device, neuron_device, devices)
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
