"""The upper bound of J_σ: Σ over the edges of the best co-located weighted mass w_e · f_e of that edge alone.

No layout can beat it, since J_σ is the sum of the edges' terms. Per dense edge, exact by branch
and bound over the balanced partitions of its smaller side (the KV groups of a chain edge), each solved
by an exact balanced assignment of the other side, where they are few enough, otherwise a looser valid
bound; a sparse edge (`SparseEdge`) gets the looser bound without being densified. Pure numpy.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from models.optimise.assignment import REL_TOL, blockwise_balanced_assignment
from models.optimise.edges import EdgeMatrix, Pair, SparseEdge, edge_kind
from models.optimise.problem import Problem, check_devices, edges_of, neuron_blocks

_GAIN_CHUNK = 1 << 22  # floats per temporary when scoring group partitions in bulk


@dataclass(frozen=True)
class UpperBound:
    """Σ over edges of the best co-located term w_e · f_e of that edge alone; `exact` when every term is exact."""

    devices: int
    value: float
    exact: bool
    edges: dict[Pair, float]  # per edge (m, t), in edge order

    @property
    def up(self) -> list[float]:
        """The chain's up edges (2i, 2i+1) that the schedule has."""
        return [v for (m, t), v in self.edges.items() if m % 2 == 0 and t == m + 1]

    @property
    def down(self) -> list[float]:
        """The chain's down edges (2i+1, 2i+2) that the schedule has."""
        return [v for (m, t), v in self.edges.items() if m % 2 == 1 and t == m + 1]


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


def _edge_bound_exact(matrix: np.ndarray, devices: int, experts: int = 1) -> float:
    """max over balanced (group partition, neuron assignment) of the co-located mass of one [G, I] edge
    (an MoE model's neurons balanced per expert: `experts` blocks of them).

    Branch and bound over the group partitions: solve partitions exactly in decreasing order of their
    relaxed value (neurons ignoring balance) until the best exact value reaches the next relaxed one.
    """
    groups, neurons = matrix.shape
    blocks, partitions = _unlabelled_partitions(groups, devices)  # [B, G/L], [P, L]
    relaxed = _relaxed_partition_values(matrix, blocks, partitions)  # [P]
    slack = REL_TOL * float(relaxed.max())
    best = -np.inf
    for p in np.argsort(-relaxed, kind="stable"):
        if best >= relaxed[p] - slack:
            break
        gain = matrix[blocks[partitions[p]]].sum(axis=1).T  # [I, L]
        assign = blockwise_balanced_assignment(gain, experts)
        best = max(best, float(gain[np.arange(neurons), assign].sum()))
    return best


def _edge_bound(matrix: np.ndarray, devices: int, max_partitions: int, blocks: int = 1) -> tuple[float, bool]:
    """Bound for one normalised dense edge whose first axis (the smaller side) is partitioned; (value, exact)."""
    if not matrix.any():
        return 0.0, True
    if devices == 1:
        return float(matrix.sum()), True
    if partition_count(matrix.shape[0], devices) > max_partitions:
        return _edge_bound_relaxed(matrix, devices), False
    return _edge_bound_exact(matrix, devices, blocks), True


def _largest_per_group(group: np.ndarray, value: np.ndarray, count: int) -> float:
    """Σ over groups of the `count` largest values of each group (entries [nnz] with a group id each)."""
    order = np.lexsort((-value, group))  # by group, largest first within one
    group, value = group[order], value[order]
    rank = np.arange(len(group)) - np.searchsorted(group, group, side="left")  # place within its group
    return float(value[rank < count].sum())


def _sparse_bound(matrix: SparseEdge, devices: int) -> float:
    """A valid bound of a sparse edge without densifying it: each sender shares a device with C/L receivers
    and each receiver with R/L senders, so neither collects more than its largest kept entries."""
    rows, cols = matrix.shape
    by_row = _largest_per_group(matrix.rows, matrix.values, cols // devices)
    by_col = _largest_per_group(matrix.cols, matrix.values, rows // devices)
    return float(min(by_row, by_col, matrix.values.sum()))


def _one_edge_bound(matrix: EdgeMatrix, devices: int, max_partitions: int, blocks: int = 1,
                    kind: str = "up") -> tuple[float, bool]:
    """The best co-located mass of one (weighted) edge alone; (value, exact). `blocks`: the experts an FFN's
    neurons are balanced in (1: dense); `kind`: the edge's (`edge_kind`). A KV group → KV group edge has no
    neurons (its blocks are 1); a neuron → neuron edge's partitioned side, and its relaxed bound, ignore the
    experts (still valid, not exact)."""
    if isinstance(matrix, SparseEdge):
        return _sparse_bound(matrix, devices), False
    rows, cols = matrix.shape
    # _edge_bound enumerates the partitions of its first axis and assigns the other in `blocks`: give it the
    # smaller side (a chain's down edge [I, G] is bounded as its transpose, its neurons assigned).
    value, exact = _edge_bound(matrix if rows <= cols else matrix.T, devices, max_partitions,
                               1 if kind == "kv-kv" else blocks)
    return value, exact and not (kind == "neuron-neuron" and blocks > 1)


def upper_bound(affinity: Problem, devices: int, *, max_partitions: int = 20000) -> UpperBound:
    """Σ over the edges of the best co-located term w_e · f_e of that edge optimised alone (cached per affinity).

    No layout can beat it, since J_σ is the sum of the edges' terms. Exact where every dense edge's
    partitions number at most `max_partitions` and no edge is sparse, otherwise a looser valid bound with
    exact=False.
    """
    check_devices(affinity, devices)
    sigma = edges_of(affinity)
    key = ("upper_bound", devices, max_partitions)
    if key not in sigma._cache:
        weighted = sigma.weighted()
        blocks = neuron_blocks(affinity)
        per = {p: _one_edge_bound(m, devices, max_partitions, blocks, edge_kind(p))
               for p, m in weighted.edges.items()}
        sigma._cache[key] = UpperBound(int(devices), float(sum(v for v, _ in per.values())),
                                       all(e for _, e in per.values()), {p: v for p, (v, _) in per.items()})
    result: UpperBound = sigma._cache[key]
    return result
