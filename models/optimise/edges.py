"""The edges of a schedule's layout objective J_σ (issue 20) and the affinity matrices on them.

Modules n = 0 .. M-1 (M = 2N; even n: attention of layer n/2, whose units are its G KV groups; odd n:
its FFN, whose units are its I neurons). Before module t a device's stream holds its own partial of
module m once b_m ≤ t and the others' once a_m ≤ t, so for every pair

    m < t with b_m ≤ t < a_m      (a_m = ∞: every t ≥ b_m)

a unit of t reads the units of m on its own device only, and co-locating them pays. Each such pair is an
edge of J_σ with a matrix [U_m, U_t] (sender units × receiver units). At dtp:1 the edges are the chain's
(2i, 2i+1) up and (2i+1, 2i+2) down edges, exactly the paper's. Pure numpy.

An edge matrix is dense (`np.ndarray`) or `TopRows`: the k largest entries of each row of an [R, C]
matrix, for the neuron → neuron edges whose I×I dense form does not fit (docs/schedules_objective.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models.schedules.grammar import Schedule

Pair = tuple[int, int]


def schedule_pairs(schedule: Schedule) -> list[Pair]:
    """Every (m, t), m < t < M, with b_m ≤ t < a_m: the edges of J_σ, ordered by m then t."""
    M = schedule.num_modules
    pairs = []
    for m in range(M):
        others = schedule.other_arrival[m]
        end = M if others is None else min(others, M)
        pairs += [(m, t) for t in range(max(schedule.own_arrival[m], m + 1), end)]
    return pairs


def chain_pairs(num_layers: int) -> list[Pair]:
    """The paper's edges (dtp:1): (n, n+1) for every n ≤ M-2."""
    return [(n, n + 1) for n in range(2 * num_layers - 1)]


def edge_kind(pair: Pair) -> str:
    """'up' (KV group → neuron), 'down' (neuron → KV group), 'kv-kv' or 'neuron-neuron'."""
    m, t = pair
    return {(0, 1): "up", (1, 0): "down", (0, 0): "kv-kv", (1, 1): "neuron-neuron"}[(m % 2, t % 2)]


def edge_name(pair: Pair) -> str:
    """'attn0→ffn0', 'ffn2→ffn3', …: the edge as its modules."""
    def module(n: int) -> str:
        return f"{'attn' if n % 2 == 0 else 'ffn'}{n // 2}"
    return f"{module(pair[0])}→{module(pair[1])}"


@dataclass(frozen=True, eq=False)
class TopRows:
    """The k largest entries of each row of an [R, C] non-negative matrix: indices/values [R, k].

    `total` is the full matrix's mass (so that a normalised TopRows is a fraction of the dense edge);
    `kept_mass` = values.sum() / total.
    """

    indices: np.ndarray  # [R, k] int64 column ids
    values: np.ndarray  # [R, k] float64
    columns: int
    total: float

    @classmethod
    def of(cls, matrix: np.ndarray, k: int) -> TopRows:
        matrix = np.asarray(matrix, dtype=np.float64)
        k = min(k, matrix.shape[1])
        idx = np.argpartition(-matrix, k - 1, axis=1)[:, :k]  # [R, k]
        return cls(idx.astype(np.int64), np.take_along_axis(matrix, idx, axis=1), matrix.shape[1],
                   float(matrix.sum()))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.indices.shape[0], self.columns)

    @property
    def kept_mass(self) -> float:
        return float(self.values.sum() / self.total) if self.total > 0 else 1.0

    def dense(self) -> np.ndarray:
        out = np.zeros(self.shape)
        np.put_along_axis(out, self.indices, self.values, axis=1)
        return out


EdgeMatrix = np.ndarray | TopRows


def edge_mass(matrix: EdgeMatrix) -> float:
    """The mass J_σ normalises the edge by (a TopRows: its dense matrix's)."""
    return matrix.total if isinstance(matrix, TopRows) else float(matrix.sum())


def normalised(matrix: EdgeMatrix) -> EdgeMatrix:
    """Scaled to unit (dense) mass; an all-zero edge stays zero."""
    total = edge_mass(matrix)
    if isinstance(matrix, TopRows):
        values = matrix.values / total if total > 0 else matrix.values.copy()
        return TopRows(matrix.indices, values, matrix.columns, 1.0 if total > 0 else 0.0)
    return matrix / total if total > 0 else matrix.copy()


def one_hot(assign: np.ndarray, devices: int) -> np.ndarray:
    return (assign[:, None] == np.arange(devices)).astype(np.float64)  # [n, L]


def sender_gain(matrix: EdgeMatrix, receiver_device: np.ndarray, devices: int) -> np.ndarray:
    """[R, L]: the mass each sending unit shares with device l's receiving units."""
    if isinstance(matrix, TopRows):
        dev = receiver_device[matrix.indices]  # [R, k]
        rows = np.arange(matrix.indices.shape[0])[:, None] * devices
        return np.bincount((rows + dev).ravel(), weights=matrix.values.ravel(),
                           minlength=matrix.indices.shape[0] * devices).reshape(-1, devices)
    return matrix @ one_hot(receiver_device, devices)


def receiver_gain(matrix: EdgeMatrix, sender_device: np.ndarray, devices: int) -> np.ndarray:
    """[C, L]: the mass each receiving unit shares with device l's sending units."""
    if isinstance(matrix, TopRows):
        dev = np.broadcast_to(sender_device[:, None], matrix.indices.shape)  # [R, k]
        return np.bincount((matrix.indices * devices + dev).ravel(), weights=matrix.values.ravel(),
                           minlength=matrix.columns * devices).reshape(-1, devices)
    return matrix.T @ one_hot(sender_device, devices)


def co_located(matrix: EdgeMatrix, sender_device: np.ndarray, receiver_device: np.ndarray) -> float:
    """Σ_{u, v: dev(u) = dev(v)} matrix[u, v]."""
    if isinstance(matrix, TopRows):
        together = sender_device[:, None] == receiver_device[matrix.indices]  # [R, k]
        return float(np.where(together, matrix.values, 0.0).sum())
    together = sender_device[:, None] == receiver_device[None, :]
    return float(np.where(together, matrix, 0.0).sum())


def _check_edge(pair: Pair, matrix: EdgeMatrix, shape: tuple[int, int]) -> None:
    where = f"edge {edge_name(pair)} (modules {pair[0]}→{pair[1]})"
    if matrix.shape != shape:
        raise ValueError(f"{where}: expected shape {list(shape)}, got {list(matrix.shape)}")
    values = matrix.values if isinstance(matrix, TopRows) else matrix
    if not np.isfinite(values).all():
        raise ValueError(f"{where}: contains NaN or inf")
    if values.size and values.min() < 0:
        raise ValueError(f"{where}: affinities must be non-negative, found {values.min():.3g}")
    if isinstance(matrix, TopRows) and matrix.indices.size and not (
            matrix.indices.min() >= 0 and matrix.indices.max() < matrix.columns):
        raise ValueError(f"{where}: top-k column ids outside 0 .. {matrix.columns - 1}")


@dataclass(frozen=True, eq=False)
class ScheduleAffinity:
    """The affinity matrices of a schedule's edges: `edges[(m, t)]` [U_m, U_t], non-negative, finite.

    `schedule` names the schedule the edges are of (its canonical string). An empty `edges` is a
    layout-independent schedule (tp, ladder): every layout scores 0.
    """

    schedule: str
    num_layers: int
    num_kv_groups: int
    intermediate_size: int
    edges: dict[Pair, EdgeMatrix]
    _cache: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        M = 2 * self.num_layers
        for pair, matrix in self.edges.items():
            m, t = pair
            if not 0 <= m < t < M:
                raise ValueError(f"edge {pair}: needs 0 ≤ m < t < M={M}")
            _check_edge(pair, matrix, (self.units(m), self.units(t)))

    def units(self, n: int) -> int:
        """U_n: KV groups of an attention, neurons of an FFN."""
        return self.num_kv_groups if n % 2 == 0 else self.intermediate_size

    @property
    def layout_independent(self) -> bool:
        return not self.edges

    def normalised(self) -> ScheduleAffinity:
        """Every edge scaled to unit mass (cached)."""
        if "normalised" not in self._cache:
            unit = ScheduleAffinity(self.schedule, self.num_layers, self.num_kv_groups, self.intermediate_size,
                                    {p: normalised(m) for p, m in self.edges.items()})
            unit._cache["normalised"] = unit
            self._cache["normalised"] = unit
        result: ScheduleAffinity = self._cache["normalised"]
        return result

    def edge_masses(self) -> dict[Pair, float]:
        return {p: edge_mass(m) for p, m in self.edges.items()}

    def kept_mass(self) -> dict[Pair, float]:
        """Per sparse (top-k) edge, the fraction of its dense mass kept."""
        return {p: m.kept_mass for p, m in self.edges.items() if isinstance(m, TopRows)}

    def incoming(self, n: int) -> list[Pair]:
        return [p for p in self.edges if p[1] == n]

    def outgoing(self, n: int) -> list[Pair]:
        return [p for p in self.edges if p[0] == n]


def module_devices(heads: np.ndarray, cells: np.ndarray, n: int) -> np.ndarray:
    """The device of each unit of module n under the layout ([N, G] heads, [N, I] cells)."""
    return heads[n // 2] if n % 2 == 0 else cells[n // 2]


def chain_affinity(up: list[np.ndarray], down: list[np.ndarray], schedule: str = "dtp:1") -> ScheduleAffinity:
    """The paper's chain (up[i] on (2i, 2i+1), down[i] on (2i+1, 2i+2)) as a ScheduleAffinity."""
    edges: dict[Pair, EdgeMatrix] = {}
    for i, matrix in enumerate(up):
        edges[(2 * i, 2 * i + 1)] = np.asarray(matrix, dtype=np.float64)
        if i < len(down):
            edges[(2 * i + 1, 2 * i + 2)] = np.asarray(down[i], dtype=np.float64)
    groups, neurons = np.asarray(up[0]).shape
    return ScheduleAffinity(schedule, len(up), int(groups), int(neurons), edges)
