"""The edges of a schedule's layout objective J_σ (issue 20) and the affinity matrices on them.

Modules n = 0 .. M-1 (M = 2N; even n: attention of layer n/2, whose units are its G KV groups; odd n:
its FFN, whose units are its I neurons). Before module t a device's stream holds its own partial of
module m once b_m ≤ t and the others' once a_m ≤ t, so for every pair

    m < t with b_m ≤ t < a_m      (a_m = ∞: every t ≥ b_m)

a unit of t reads the units of m on its own device only, and co-locating them pays. Each such pair is an
edge of J_σ with a matrix [U_m, U_t] (sender units × receiver units). At dtp:1 the edges are the chain's
(2i, 2i+1) up and (2i+1, 2i+2) down edges, exactly the paper's. Pure numpy.

An edge matrix is dense (`np.ndarray`) or `SparseEdge`: the largest entries of an [R, C] matrix up to a
kept mass, for the neuron → neuron edges whose I×I dense form does not fit (docs/schedules_objective.md).

Each edge enters J_σ with the weight of its first-order damage (issue 29): its raw mass over the raw
mass of the paper's edge into the same receiving module, (t-1, t) — the reference whose scores are in
the same units (a receiving FFN's scores are residual-stream damage, a receiving attention's are q/k/v
pre-activation changes, so only edges into the same receiver compare). The paper's edges weigh 1, so
at dtp:1 J_σ is objective (6) exactly. `weighting="unit"` keeps every edge at unit mass (issue 20).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from models.schedules.grammar import Schedule

Pair = tuple[int, int]
Weighting = Literal["damage", "unit"]
WEIGHTINGS = ("damage", "unit")


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
class SparseEdge:
    """Some entries of an [R, C] non-negative matrix, as (row, column, value) triples [nnz].

    `total` is the full matrix's mass, so `kept_mass` = values.sum() / total says how much of the dense
    edge the kept entries carry. `keeping` keeps the largest entries until a mass fraction is reached
    (the neuron → neuron edges whose I×I dense form does not fit); `top_k` the k largest of each row
    (the form files written before issue 29 hold).
    """

    rows: np.ndarray  # [nnz] int32 sender ids (int32: 16 bytes an entry with its value, twice dense's)
    cols: np.ndarray  # [nnz] int32 receiver ids
    values: np.ndarray  # [nnz] float64
    shape: tuple[int, int]
    total: float

    @classmethod
    def keeping(cls, matrix: np.ndarray, mass: float, max_entries: int | None = None) -> SparseEdge:
        """The fewest largest entries whose sum is ≥ `mass` of the total, at most `max_entries` of them."""
        matrix = np.asarray(matrix, dtype=np.float64)
        flat = matrix.ravel()
        total = float(flat.sum())
        order = np.argsort(-flat, kind="stable")  # [R*C] largest first
        running = np.cumsum(flat[order])
        count = int(np.searchsorted(running, mass * total, side="left")) + 1 if total > 0 else 0
        count = min(count, flat.size, flat.size if max_entries is None else max(0, max_entries))
        keep = np.sort(order[:count])  # row-major order: rows ascending
        rows, cols = np.divmod(keep, matrix.shape[1])
        return cls(rows.astype(np.int32), cols.astype(np.int32), flat[keep], matrix.shape, total)

    @classmethod
    def top_k(cls, matrix: np.ndarray, k: int) -> SparseEdge:
        """The k largest entries of each row."""
        matrix = np.asarray(matrix, dtype=np.float64)
        k = min(k, matrix.shape[1])
        idx = np.argpartition(-matrix, k - 1, axis=1)[:, :k]  # [R, k]
        return cls.from_rows(idx, np.take_along_axis(matrix, idx, axis=1), matrix.shape[1], float(matrix.sum()))

    @classmethod
    def from_rows(cls, indices: np.ndarray, values: np.ndarray, columns: int, total: float) -> SparseEdge:
        """From per-row column ids and values [R, k] (an old file's top-k rows)."""
        indices = np.asarray(indices, dtype=np.int32)
        rows = np.repeat(np.arange(indices.shape[0], dtype=np.int32), indices.shape[1])
        return cls(rows, indices.ravel(), np.asarray(values, dtype=np.float64).ravel(),
                   (int(indices.shape[0]), int(columns)), float(total))

    @property
    def kept_mass(self) -> float:
        return float(self.values.sum() / self.total) if self.total > 0 else 1.0

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes + self.cols.nbytes + self.values.nbytes)

    def scaled(self, divisor: float) -> SparseEdge:
        return SparseEdge(self.rows, self.cols, self.values / divisor, self.shape, self.total / divisor)

    def dense(self) -> np.ndarray:
        out = np.zeros(self.shape)
        out[self.rows, self.cols] = self.values
        return out


EdgeMatrix = np.ndarray | SparseEdge


def edge_mass(matrix: EdgeMatrix) -> float:
    """The edge's raw mass (a sparse edge: its dense matrix's): its first-order damage summed."""
    return matrix.total if isinstance(matrix, SparseEdge) else float(matrix.sum())


def scaled(matrix: EdgeMatrix, divisor: float) -> EdgeMatrix:
    """matrix / divisor; unchanged (a copy) for a divisor of 0, an all-zero edge's."""
    if isinstance(matrix, SparseEdge):
        return matrix.scaled(divisor) if divisor > 0 else matrix
    return matrix / divisor if divisor > 0 else matrix.copy()


def normalised(matrix: EdgeMatrix) -> EdgeMatrix:
    """Scaled to unit (dense) mass; an all-zero edge stays zero."""
    return scaled(matrix, edge_mass(matrix))


def one_hot(assign: np.ndarray, devices: int) -> np.ndarray:
    return (assign[:, None] == np.arange(devices)).astype(np.float64)  # [n, L]


def sender_gain(matrix: EdgeMatrix, receiver_device: np.ndarray, devices: int) -> np.ndarray:
    """[R, L]: the mass each sending unit shares with device l's receiving units."""
    if isinstance(matrix, SparseEdge):
        slot = matrix.rows * devices + receiver_device[matrix.cols]  # [nnz]
        return np.bincount(slot, weights=matrix.values, minlength=matrix.shape[0] * devices).reshape(-1, devices)
    return matrix @ one_hot(receiver_device, devices)


def receiver_gain(matrix: EdgeMatrix, sender_device: np.ndarray, devices: int) -> np.ndarray:
    """[C, L]: the mass each receiving unit shares with device l's sending units."""
    if isinstance(matrix, SparseEdge):
        slot = matrix.cols * devices + sender_device[matrix.rows]  # [nnz]
        return np.bincount(slot, weights=matrix.values, minlength=matrix.shape[1] * devices).reshape(-1, devices)
    return matrix.T @ one_hot(sender_device, devices)


def co_located(matrix: EdgeMatrix, sender_device: np.ndarray, receiver_device: np.ndarray) -> float:
    """Σ_{u, v: dev(u) = dev(v)} matrix[u, v]."""
    if isinstance(matrix, SparseEdge):
        together = sender_device[matrix.rows] == receiver_device[matrix.cols]  # [nnz]
        return float(np.where(together, matrix.values, 0.0).sum())
    together = sender_device[:, None] == receiver_device[None, :]
    return float(np.where(together, matrix, 0.0).sum())


def _check_edge(pair: Pair, matrix: EdgeMatrix, shape: tuple[int, int]) -> None:
    where = f"edge {edge_name(pair)} (modules {pair[0]}→{pair[1]})"
    if matrix.shape != shape:
        raise ValueError(f"{where}: expected shape {list(shape)}, got {list(matrix.shape)}")
    values = matrix.values if isinstance(matrix, SparseEdge) else matrix
    if not np.isfinite(values).all():
        raise ValueError(f"{where}: contains NaN or inf")
    if values.size and values.min() < 0:
        raise ValueError(f"{where}: affinities must be non-negative, found {values.min():.3g}")
    if isinstance(matrix, SparseEdge) and matrix.values.size:
        for name, ids, size in (("row", matrix.rows, shape[0]), ("column", matrix.cols, shape[1])):
            if ids.shape != matrix.values.shape or ids.min() < 0 or ids.max() >= size:
                raise ValueError(f"{where}: sparse {name} ids outside 0 .. {size - 1} or not one per value")


@dataclass(frozen=True, eq=False)
class ScheduleAffinity:
    """The affinity matrices of a schedule's edges: `edges[(m, t)]` [U_m, U_t], non-negative, finite.

    `schedule` names the schedule the edges are of (its canonical string). An empty `edges` is a
    layout-independent schedule (tp, ladder): every layout scores 0. `experts` > 0: an MoE model, whose FFN
    units are E experts' neurons expert-major (issue 46), each expert balanced over the devices on its own.
    """

    schedule: str
    num_layers: int
    num_kv_groups: int
    intermediate_size: int
    edges: dict[Pair, EdgeMatrix]
    weighting: Weighting = "damage"
    experts: int = 0
    _cache: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        M = 2 * self.num_layers
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}")
        check_experts(self.experts, self.intermediate_size)
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

    def with_weighting(self, weighting: Weighting) -> ScheduleAffinity:
        """The same edges under another weighting."""
        return ScheduleAffinity(self.schedule, self.num_layers, self.num_kv_groups, self.intermediate_size,
                                self.edges, weighting, self.experts)

    def normalised(self) -> ScheduleAffinity:
        """Every edge scaled to unit mass (cached): the edges' co-located fractions."""
        if "normalised" not in self._cache:
            unit = ScheduleAffinity(self.schedule, self.num_layers, self.num_kv_groups, self.intermediate_size,
                                    {p: normalised(m) for p, m in self.edges.items()}, "unit", self.experts)
            unit._cache["normalised"] = unit
            self._cache["normalised"] = unit
        result: ScheduleAffinity = self._cache["normalised"]
        return result

    def reference_mass(self, t: int) -> float:
        """E_ref(t): the raw mass of the paper's edge (t-1, t) into module t; where σ lacks it or it is all
        zero (no preset does), the mean raw mass of σ's non-zero edges into t. 0 when t receives nothing."""
        masses = self.edge_masses()
        if masses.get((t - 1, t), 0.0) > 0:
            return masses[(t - 1, t)]
        into = [v for (_, r), v in masses.items() if r == t and v > 0]
        return float(np.mean(into)) if into else 0.0

    def divisor(self, pair: Pair) -> float:
        """What the edge's matrix is divided by in J_σ: E_ref(t) (damage) or its own mass (unit)."""
        return self.reference_mass(pair[1]) if self.weighting == "damage" else self.edge_masses()[pair]

    def weights(self) -> dict[Pair, float]:
        """w_e = E_e / divisor: the edge's weight in J_σ (1 for every non-zero edge under unit weighting and
        for the paper's edges under damage weighting; 0 for an all-zero edge)."""
        masses = self.edge_masses()
        return {p: masses[p] / d if (d := self.divisor(p)) > 0 else 0.0 for p in self.edges}

    def weighted(self) -> ScheduleAffinity:
        """What J_σ sums (cached): edge e as Ŝ_e · w_e = S_e / divisor(e). A paper's edge is divided by its
        own mass under either weighting, bit for bit as `normalised`."""
        if "weighted" not in self._cache:
            edges = {p: scaled(m, self.divisor(p)) for p, m in self.edges.items()}
            self._cache["weighted"] = ScheduleAffinity(self.schedule, self.num_layers, self.num_kv_groups,
                                                       self.intermediate_size, edges, self.weighting, self.experts)
        result: ScheduleAffinity = self._cache["weighted"]
        return result

    def edge_masses(self) -> dict[Pair, float]:
        if "masses" not in self._cache:
            self._cache["masses"] = {p: edge_mass(m) for p, m in self.edges.items()}
        result: dict[Pair, float] = self._cache["masses"]
        return result

    def kept_mass(self) -> dict[Pair, float]:
        """Per sparse edge, the fraction of its dense mass kept."""
        return {p: m.kept_mass for p, m in self.edges.items() if isinstance(m, SparseEdge)}

    def incoming(self, n: int) -> list[Pair]:
        return [p for p in self.edges if p[1] == n]

    def outgoing(self, n: int) -> list[Pair]:
        return [p for p in self.edges if p[0] == n]


def check_experts(experts: int, neurons: int) -> None:
    """Raise unless `experts` (0: a dense FFN) splits the FFN's units into equal experts."""
    if not isinstance(experts, int | np.integer) or experts < 0 or (experts and neurons % experts):
        raise ValueError(f"experts must be 0 (a dense FFN) or a positive divisor of the FFN units ({neurons}), "
                         f"got {experts!r}")


def module_devices(heads: np.ndarray, cells: np.ndarray, n: int) -> np.ndarray:
    """The device of each unit of module n under the layout ([N, G] heads, [N, I] cells)."""
    return heads[n // 2] if n % 2 == 0 else cells[n // 2]


def chain_affinity(up: list[np.ndarray], down: list[np.ndarray], schedule: str = "dtp:1",
                   experts: int = 0) -> ScheduleAffinity:
    """The paper's chain (up[i] on (2i, 2i+1), down[i] on (2i+1, 2i+2)) as a ScheduleAffinity."""
    edges: dict[Pair, EdgeMatrix] = {}
    for i, matrix in enumerate(up):
        edges[(2 * i, 2 * i + 1)] = np.asarray(matrix, dtype=np.float64)
        if i < len(down):
            edges[(2 * i + 1, 2 * i + 2)] = np.asarray(down[i], dtype=np.float64)
    groups, neurons = np.asarray(up[0]).shape
    return ScheduleAffinity(schedule, len(up), int(groups), int(neurons), edges, experts=experts)
