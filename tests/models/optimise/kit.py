"""Shared helpers of the optimiser tests: random affinities and layouts, and slow literal transcriptions."""

from __future__ import annotations

import functools
import itertools

import numpy as np

from models.optimise import Affinity, contiguous_row


def affinity_of(layers: int, groups: int, neurons: int, seed: int, zero_edges: tuple[str, ...] = ()) -> Affinity:
    """Heavy-tailed random affinities; `zero_edges` names matrices ("up1", "down0") to leave all zero."""
    rng = np.random.default_rng(seed)
    up = [rng.lognormal(0.0, 1.5, (groups, neurons)) for _ in range(layers)]
    down = [rng.lognormal(0.0, 1.5, (neurons, groups)) for _ in range(layers - 1)]
    for name in zero_edges:
        (up if name.startswith("up") else down)[int(name[-1])][:] = 0.0
    return Affinity(up, down)


def random_layout(affinity: Affinity, devices: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = affinity.num_layers
    heads = np.stack([rng.permutation(contiguous_row(affinity.num_kv_groups, devices)) for _ in range(n)])
    cells = np.stack([rng.permutation(contiguous_row(affinity.intermediate_size, devices)) for _ in range(n)])
    return heads, cells


@functools.cache
def all_balanced(width: int, devices: int) -> np.ndarray:
    """Every balanced assignment of `width` units to `devices` devices: [count, width]."""
    return np.array(sorted(set(itertools.permutations(contiguous_row(width, devices).tolist()))))


def literal_J(affinity: Affinity, heads: np.ndarray, cells: np.ndarray) -> float:
    """Equation (6) transcribed: a double loop over (g, k) per edge on unit-mass matrices."""
    total = 0.0
    for i in range(affinity.num_layers):
        mass = affinity.up[i].sum()
        for g in range(affinity.num_kv_groups):
            for k in range(affinity.intermediate_size):
                if heads[i, g] == cells[i, k] and mass > 0:
                    total += affinity.up[i][g, k] / mass
    for i in range(affinity.num_layers - 1):
        mass = affinity.down[i].sum()
        for k in range(affinity.intermediate_size):
            for g in range(affinity.num_kv_groups):
                if cells[i, k] == heads[i + 1, g] and mass > 0:
                    total += affinity.down[i][k, g] / mass
    return total


def brute_edge_max(matrix: np.ndarray, devices: int) -> float:
    """max over all balanced (group assignment, neuron assignment) of the co-located mass of a [G, I] edge."""
    groups, neurons = matrix.shape
    hs = all_balanced(groups, devices)  # [H, G]
    nus = all_balanced(neurons, devices)  # [V, I]
    best = 0.0
    for h in hs:
        together = h[None, :, None] == nus[:, None, :]  # [V, G, I]
        best = max(best, float(np.where(together, matrix, 0.0).sum(axis=(1, 2)).max()))
    return best
