"""The optimiser's input: the paper's chain of per-layer affinity matrices, or a schedule's edges; device counts.

A model with N layers, G KV groups and I FFN neurons per layer has, in the paper's chain (dtp:1), 2N-1
edges: the up edge of layer i ([G, I], neurons of layer i on the KV groups of layer i) and the down edge
of layer i < N-1 ([I, G], KV groups of layer i+1 on the neurons of layer i). `Affinity` holds them;
`Affinity.edges()` is the same chain as the edges of J_σ at dtp:1 (`models.optimise.edges`), which is
what the objective, the bound and the ascent read (`edges_of`). A schedule's `ScheduleAffinity` is the
other kind of input. L devices must divide both G and I. Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models.optimise.edges import ScheduleAffinity, chain_affinity, check_experts


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
    Non-negative and finite; stored as read-only float64 copies. experts > 0: an MoE model, its I = E·I_e
    units its experts' neurons expert-major, each expert balanced over the devices on its own (issue 46).
    """

    up: list[np.ndarray]
    down: list[np.ndarray]
    experts: int = 0
    _cache: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "up", [_frozen_float(m) for m in self.up])
        object.__setattr__(self, "down", [_frozen_float(m) for m in self.down])
        _validate_affinity(self.up, self.down)
        check_experts(self.experts, self.intermediate_size)

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
            unit = Affinity([_unit_mass(m) for m in self.up], [_unit_mass(m) for m in self.down], self.experts)
            unit._cache["normalised"] = unit
            self._cache["normalised"] = unit
        result: Affinity = self._cache["normalised"]
        return result

    def edge_masses(self) -> np.ndarray:
        """Total mass of each edge, up edges then down edges: [2N-1]."""
        return np.array([m.sum() for m in [*self.up, *self.down]])

    def edges(self) -> ScheduleAffinity:
        """The chain as the edges of J_σ at dtp:1: up[i] on (2i, 2i+1), down[i] on (2i+1, 2i+2); cached."""
        if "edges" not in self._cache:
            self._cache["edges"] = chain_affinity(self.up, self.down, experts=self.experts)
        result: ScheduleAffinity = self._cache["edges"]
        return result


# What the objective, the bound and the ascent take: the paper's chain, or a schedule's edges.
Problem = Affinity | ScheduleAffinity


def edges_of(affinity: Problem) -> ScheduleAffinity:
    """The edges J_σ sums over: a schedule's own, or the chain's (J_σ at dtp:1 is objective (6))."""
    return affinity.edges() if isinstance(affinity, Affinity) else affinity


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


def valid_device_counts(groups: int, neurons: int) -> list[int]:
    return [d for d in range(1, groups + 1) if groups % d == 0 and neurons % d == 0]


def neuron_blocks(affinity: Problem) -> int:
    """The blocks of an FFN's units balanced over the devices each on its own: the experts, or 1 (dense)."""
    return max(1, affinity.experts)


def check_devices(affinity: Problem, devices: int) -> None:
    """Raise ValueError unless `devices` divides both the KV groups and the FFN width (an MoE model: each
    expert's width)."""
    groups, blocks = affinity.num_kv_groups, neuron_blocks(affinity)
    neurons = affinity.intermediate_size // blocks
    width = "intermediate_size" if blocks == 1 else "expert_size"
    if not isinstance(devices, int | np.integer) or devices < 1:
        raise ValueError(f"devices must be a positive integer, got {devices!r}")
    bad = [f"{name}={size}" for name, size in (("num_kv_groups", groups), (width, neurons)) if size % devices]
    if bad:
        valid = ", ".join(map(str, valid_device_counts(groups, neurons)))
        raise ValueError(f"devices L={devices} does not divide {' and '.join(bad)}; valid L: {valid}")


def contiguous_row(width: int, devices: int, blocks: int = 1) -> np.ndarray:
    """Storage order sliced into L shards: unit u on device u // (width / L); with `blocks` (an MoE layer's
    experts) each block sliced so, its first width/(blocks·L) units on device 0 and so on. [width]"""
    return np.tile(np.repeat(np.arange(devices), width // blocks // devices), blocks)


def contiguous_layout(affinity: Problem, devices: int) -> tuple[np.ndarray, np.ndarray]:
    """The storage-order layout as arrays: kv_group_device [N, G], neuron_device [N, I]."""
    check_devices(affinity, devices)
    n = affinity.num_layers
    heads = np.tile(contiguous_row(affinity.num_kv_groups, devices), (n, 1))  # [N, G]
    cells = np.tile(contiguous_row(affinity.intermediate_size, devices, neuron_blocks(affinity)), (n, 1))  # [N, I]
    return heads, cells
