"""Exact assignment of n units to L sinks with fixed capacities: a transportation problem.

Maximise (or minimise) Σ_u gain[u, a(u)] over assignments a that put exactly capacity[l] units on
sink l. It is a min-cost flow from n unit sources to L sinks, and since L is small (the devices)
it is solved on the L-node sink graph rather than on the n×L bipartite graph:

1. prices p [L] from coordinate descent on the dual, so that each unit's favourite sink
   (argmax_l value[u, l] − p_l) is nearly within capacity: an assignment optimal for its own counts;
2. successive shortest paths on the sink graph (an edge a → b costs the cheapest single-unit move)
   from over-full to under-full sinks, which keeps it optimal for the new counts;
3. cancelling any improving cycle of single-unit moves that rounding left: the absence of one is the
   min-cost-flow optimality certificate.

Nothing here knows about layouts; `balanced_assignment` is the equal-capacity case the optimiser
uses. Pure numpy, deterministic.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

# Relative tolerance for "strictly better": far above float64 rounding of sums of a few gains,
# far below any difference that matters. Shared by the bound and the coordinate ascent.
REL_TOL = 1e-12
_MAX_PRICE_SWEEPS = 30


def _check_shape(gain: np.ndarray) -> np.ndarray:
    gain = np.asarray(gain, dtype=np.float64)
    if gain.ndim != 2:
        raise ValueError(f"gain must be a 2-D [units, devices] array, got shape {list(gain.shape)}")
    if gain.shape[1] < 1:
        raise ValueError("gain must have at least one device column")
    return gain


def _check_gain(gain: np.ndarray) -> np.ndarray:
    gain = _check_shape(gain)
    if np.isnan(gain).any():
        raise ValueError("gain contains NaN")
    if not np.isfinite(gain).all():
        raise ValueError("gain contains ±inf; gains must be finite")
    return gain


def _check_capacities(capacities: Sequence[int] | np.ndarray, units: int, sinks: int) -> np.ndarray:
    caps = np.asarray(capacities)
    if caps.shape != (sinks,):
        raise ValueError(f"capacities: expected one per sink ({sinks}), got shape {list(caps.shape)}")
    if caps.size and not np.issubdtype(caps.dtype, np.integer):
        raise ValueError(f"capacities must be integers, got dtype {caps.dtype}")
    caps = caps.astype(np.int64)
    if (caps < 0).any():
        raise ValueError(f"capacities must be ≥ 0, got {caps.tolist()}")
    if int(caps.sum()) != units:
        raise ValueError(f"capacities sum to {int(caps.sum())}, but there are {units} units to place")
    return caps


def _clearing_prices(value: np.ndarray, capacity: np.ndarray, tol: float) -> np.ndarray:
    """Sink prices p [L] under which each unit's favourite sink (argmax of value - p) is nearly within capacity.

    Coordinate descent on the dual Σ_u max_l (value[u,l] - p_l) + Σ_l capacity_l p_l: each step sets one
    price so that exactly capacity_l units prefer that sink, the others held fixed. It only needs to
    land close to balance; the exact repair afterwards makes the result optimal whatever it returns.
    Every capacity is in [1, n-1] here.
    """
    n, sinks = value.shape
    prices = np.zeros(sinks)
    for _ in range(_MAX_PRICE_SWEEPS):
        previous = prices.copy()
        for l in range(sinks):
            lo, hi = n - capacity[l] - 1, n - capacity[l]
            reduced = value - prices  # [n, L]
            reduced[:, l] = -np.inf
            margin = value[:, l] - reduced.max(axis=1)  # [n] highest price at which u still prefers l
            kth = np.partition(margin, (lo, hi))
            prices[l] = 0.5 * (kth[lo] + kth[hi])
        counts = np.bincount(np.argmax(value - prices, axis=1), minlength=sinks)
        # Stalled prices mean ties (or a kink of the dual) that only the exact repair can resolve.
        if (counts == capacity).all() or np.abs(prices - previous).max() <= tol:
            break
    return prices


def _sink_edges(value: np.ndarray, assign: np.ndarray, sinks: int) -> tuple[np.ndarray, np.ndarray]:
    """Cheapest single-unit move between each pair of sinks.

    Returns loss [L, L] (loss[a, b] = min over units u on a of value[u,a] - value[u,b]; inf when a is
    empty or a == b) and the per-unit loss of moving to each sink [n, L].
    """
    n = value.shape[0]
    own = value[np.arange(n), assign]  # [n]
    unit_loss = own[:, None] - value  # [n, L]
    order = np.argsort(assign, kind="stable")
    counts = np.bincount(assign, minlength=sinks)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    loss = np.full((sinks, sinks), np.inf)
    present = counts > 0
    loss[present] = np.minimum.reduceat(unit_loss[order], starts[present], axis=0)
    np.fill_diagonal(loss, np.inf)
    return loss, unit_loss


def _shortest_paths(loss: np.ndarray, sources: np.ndarray, tol: float) -> tuple[np.ndarray, np.ndarray]:
    """Bellman-Ford on the L-node sink graph from a set of sources: distances [L], predecessors [L]."""
    sinks = loss.shape[0]
    dist = np.where(sources, 0.0, np.inf)
    pred = np.full(sinks, -1)
    for _ in range(sinks - 1):
        via = dist[:, None] + loss  # [L, L] reach b through a
        best_from = via.argmin(axis=0)  # [L]
        best = via[best_from, np.arange(sinks)]
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
            raise RuntimeError("assignment: negative cycle in the sink graph (numerical trouble)")
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


def _augment_to_capacity(value: np.ndarray, assign: np.ndarray, capacity: np.ndarray, tol: float) -> None:
    """Successive shortest paths on the sink graph from over-full to under-full sinks, in place.

    Starting from an assignment that is optimal for its own sink counts, moving a unit along a
    shortest path keeps it optimal for the new counts, so the end point at capacity is optimal.
    """
    sinks = value.shape[1]
    while True:
        counts = np.bincount(assign, minlength=sinks)
        excess = counts - capacity  # [L]
        if not excess.any():
            return
        loss, unit_loss = _sink_edges(value, assign, sinks)
        dist, pred = _shortest_paths(loss, excess > 0, tol)
        short = np.where(excess < 0, dist, np.inf)
        target = int(np.argmin(short))
        path = _trace(pred, target)
        _move_along(assign, unit_loss, loss, path, min(int(excess[path[0]]), int(-excess[target])))


def _negative_cycle(loss: np.ndarray, tol: float) -> list[int] | None:
    """A sink cycle whose moves gain more than tol in total, or None (the optimality certificate)."""
    sinks = loss.shape[0]
    dist = np.zeros(sinks)
    pred = np.full(sinks, -1)
    for _ in range(sinks):
        via = dist[:, None] + loss  # [L, L]
        best_from = via.argmin(axis=0)
        best = via[best_from, np.arange(sinks)]
        better = best < dist - tol
        if not better.any():
            return None
        dist = np.where(better, best, dist)
        pred = np.where(better, best_from, pred)
    # Still relaxing after L rounds: a node relaxed in round L has a predecessor chain of L + 1 nodes,
    # so walking back L steps lands on a cycle of the predecessor graph.
    node = int(np.flatnonzero(better)[0])
    for _ in range(sinks):
        node = int(pred[node])
    cycle = [node]
    while (prev := int(pred[cycle[-1]])) != node:
        cycle.append(prev)
    cycle = [node, *cycle[::-1]]  # forward order, closed: node -> ... -> node
    weight = sum(loss[a, b] for a, b in itertools.pairwise(cycle))
    return cycle if weight < -tol else None


def _cancel_negative_cycles(value: np.ndarray, assign: np.ndarray, tol: float) -> None:
    """Rounding can leave an assignment at capacity a hair from optimal; move units round improving cycles."""
    sinks = value.shape[1]
    while True:
        loss, unit_loss = _sink_edges(value, assign, sinks)
        cycle = _negative_cycle(loss, tol)
        if cycle is None:
            return
        _move_along(assign, unit_loss, loss, cycle, 1)


def transport(gain: np.ndarray, capacities: Sequence[int] | np.ndarray, maximise: bool = True) -> np.ndarray:
    """Exact optimal assignment of n units to L sinks with exactly capacities[l] units on sink l.

    gain: [n, L] finite; capacities: [L] non-negative integers summing to n. Returns a [n] int64 array
    a maximising (or minimising) Σ_u gain[u, a[u]]. Deterministic. Optimality is certified by the
    absence of an improving cycle of single-unit moves between sinks, up to a relative tolerance of
    1e-12 of the largest |gain|.
    """
    gain = _check_gain(gain)
    n, sinks = gain.shape
    capacity = _check_capacities(capacities, n, sinks)
    open_sinks = np.flatnonzero(capacity)  # a sink of capacity 0 takes no unit: solve without it
    if open_sinks.size <= 1:
        return np.full(n, open_sinks[0] if open_sinks.size else 0, dtype=np.int64)
    value = gain[:, open_sinks] if maximise else -gain[:, open_sinks]
    capacity = capacity[open_sinks]
    tol = REL_TOL * float(np.abs(value).max())
    prices = _clearing_prices(value, capacity, tol)
    assign = np.argmax(value - prices, axis=1).astype(np.int64)  # optimal for its own sink counts
    _augment_to_capacity(value, assign, capacity, tol)
    _cancel_negative_cycles(value, assign, tol)
    return open_sinks[assign].astype(np.int64)


def balanced_assignment(gain: np.ndarray, maximise: bool = True) -> np.ndarray:
    """Exact optimal assignment of n units to L devices with n/L units on every device.

    gain: [n, L]; returns a [n] int64 array a maximising (or minimising) Σ_u gain[u, a[u]].
    The equal-capacity case of `transport`.
    """
    gain = _check_shape(gain)
    n, devices = gain.shape
    if n % devices:
        raise ValueError(
            f"cannot balance {n} units over {devices} devices: the number of units must be a multiple "
            f"of the number of devices"
        )
    return transport(gain, np.full(devices, n // devices), maximise)


def blockwise_balanced_assignment(gain: np.ndarray, blocks: int, maximise: bool = True) -> np.ndarray:
    """Exact optimal assignment of n units in `blocks` equal consecutive blocks to L devices with n/(blocks·L)
    units of EVERY block on every device (an MoE layer's experts, issue 46).

    The constraint is one per block and the objective a sum over units, so the problem splits into one
    `balanced_assignment` per block; blocks=1 is `balanced_assignment`. gain: [n, L] -> [n] int64.
    """
    gain = _check_shape(gain)
    n = gain.shape[0]
    if blocks < 1 or n % blocks:
        raise ValueError(f"cannot split {n} units into {blocks} equal blocks (blocks must be ≥ 1 and divide n)")
    if blocks == 1:
        return balanced_assignment(gain, maximise)
    size = n // blocks
    return np.concatenate([balanced_assignment(gain[b * size : (b + 1) * size], maximise) for b in range(blocks)])
