"""bench/moe_expert_placement.py: J_σ of whole experts per device, from the affinity summed per expert, against a
slow transcription of J_σ over the neurons (issue 20/29's definition: each edge's co-located raw damage over the
mass of the paper's edge into its receiver), and the rule on planted affinities whose answer is known by hand."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from bench import moe_expert_placement as mep
from models.optimise.edges import ScheduleAffinity, SparseEdge
from models.optimise.objective import objective
from models.optimise.problem import Affinity, edges_of

N, G, E, SIZE, L = 3, 3, 6, 6, 3
I = E * SIZE


def slow_j(edges: dict[tuple[int, int], np.ndarray], heads: np.ndarray, cells: np.ndarray) -> float:
    """Σ over edges (m, t) of Σ_{u, v co-located} S[u, v] / (mass of edge (t-1, t)), unit by unit."""
    def device(module: int, unit: int) -> int:
        return int(heads[module // 2][unit] if module % 2 == 0 else cells[module // 2][unit])

    total = 0.0
    for (m, t), matrix in edges.items():
        reference = float(edges[(t - 1, t)].sum())
        for u in range(matrix.shape[0]):
            for v in range(matrix.shape[1]):
                if device(m, u) == device(t, v):
                    total += matrix[u, v] / reference
    return total


def balanced(rng: np.random.Generator, width: int) -> np.ndarray:
    return np.stack([rng.permutation(np.repeat(np.arange(L), width // L)) for _ in range(N)])  # [N, width]


def chain(rng: np.random.Generator) -> tuple[list[np.ndarray], list[np.ndarray]]:
    return [rng.random((G, I)) for _ in range(N)], [rng.random((I, G)) for _ in range(N - 1)]


def test_an_expert_placement_scores_as_its_neurons_on_the_chain():
    rng = np.random.default_rng(0)
    up, down = chain(rng)
    summed = edges_of(mep.expert_problem(Affinity(up, down, experts=E))).weighted()
    edges = {(2 * i, 2 * i + 1): m for i, m in enumerate(up)} | {(2 * i + 1, 2 * i + 2): m for i, m in enumerate(down)}
    for _ in range(5):
        heads, experts = balanced(rng, G), balanced(rng, E)
        cells = mep.expanded(experts, SIZE)
        assert cells.shape == (N, I) and (cells[:, :SIZE] == experts[:, :1]).all()
        assert objective(summed, heads, experts) == pytest.approx(slow_j(edges, heads, cells), rel=1e-12)


def test_an_expert_placement_scores_as_its_neurons_beyond_the_chain_sparse_edges_too():
    rng = np.random.default_rng(1)
    up, down = chain(rng)
    edges: dict[tuple[int, int], np.ndarray] = {(2 * i, 2 * i + 1): m for i, m in enumerate(up)}
    edges |= {(2 * i + 1, 2 * i + 2): m for i, m in enumerate(down)}
    edges |= {(1, 3): rng.random((I, I)), (0, 3): rng.random((G, I)), (1, 4): rng.random((I, G))}
    kept = edges[(1, 3)] * (rng.random((I, I)) < 0.3)  # a sparse edge keeps 30 % of its entries, its total all
    stored = {**edges, (1, 3): SparseEdge(*map(np.int32, np.nonzero(kept)), kept[np.nonzero(kept)], (I, I),
                                          float(edges[(1, 3)].sum()))}
    problem = ScheduleAffinity("dtp:2", N, G, I, stored, experts=E)
    summed = edges_of(mep.expert_problem(problem)).weighted()
    assert isinstance(summed.edges[(1, 3)], SparseEdge) and summed.edges[(1, 3)].shape == (E, E)
    for _ in range(5):
        heads, experts = balanced(rng, G), balanced(rng, E)
        # the slow J reads the kept entries of the sparse edge and the paper's edge's dense mass (of (2, 3))
        assert objective(summed, heads, experts) == pytest.approx(
            slow_j({**edges, (1, 3): kept}, heads, mep.expanded(experts, SIZE)), rel=1e-12)


def planted(whole_friendly: bool) -> Affinity:
    """Every up and down edge joins each FFN unit to exactly one KV group: expert e's (whole_friendly) or, inside
    every expert, neuron j's group j mod G (each expert spread evenly over the groups)."""
    up, down = [], []
    for _ in range(N):
        m = np.zeros((G, I))
        for k in range(I):
            m[(k // SIZE) // (E // G) if whole_friendly else (k % SIZE) % G, k] = 1.0
        up.append(m)
        down.append(m.T.copy())
    return Affinity(up, down[:-1], experts=E)


def test_whole_experts_win_where_each_expert_depends_on_one_group():
    # whole experts: expert e beside group e // 2 co-locates every edge (J = 2N - 1 = 5); each expert's neurons
    # split over the 3 devices co-locate a third of each edge at best (5 / 3)
    row = mep.compare(planted(True), L, restarts=2)
    assert row["whole_experts"]["J"] == pytest.approx(2 * N - 1)
    assert row["neuron_layout"]["J"] == pytest.approx((2 * N - 1) / 3)
    assert row["random_expectation"] == pytest.approx((2 * N - 1) / 3)
    assert row["verdict"] == mep.WHOLE


def test_the_neuron_layout_wins_where_every_expert_spans_the_groups():
    # neurons j of every expert beside group j mod 3: the neuron layout co-locates everything (J = 5); a whole
    # expert holds neurons of all three groups in equal shares, a third co-located wherever it goes
    row = mep.compare(planted(False), L, restarts=2)
    assert row["neuron_layout"]["J"] == pytest.approx(2 * N - 1)
    assert row["whole_experts"]["J"] == pytest.approx((2 * N - 1) / 3)
    assert row["whole_experts"]["contiguous_J"] == pytest.approx((2 * N - 1) / 3)
    assert row["verdict"] == mep.NEURON


def test_the_best_placement_is_the_brute_force_one_on_a_small_problem():
    rng = np.random.default_rng(2)
    up = [rng.random((G, I))]
    problem = Affinity(up, [], experts=E)
    row = mep.compare(problem, L, restarts=4)
    best = 0.0
    rows = {tuple(p) for p in itertools.permutations(np.repeat(np.arange(L), E // L))}
    for experts in rows:  # one layer: the heads may stay contiguous (relabelling the devices covers the rest)
        cells = mep.expanded(np.array([experts]), SIZE)
        best = max(best, slow_j({(0, 1): up[0]}, np.array([[0, 1, 2]]), cells))
    assert row["whole_experts"]["J"] == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize(("whole", "verdict"), [(10.05, mep.WHOLE), (10.049, mep.TIE), (9.951, mep.TIE),
                                                 (9.95, mep.NEURON)])
def test_the_rule_reads_one_percent_of_the_gain(whole, verdict):
    # the neuron layout's gain over random is 10 - 5 = 5, so the margin is 0.05
    assert mep.decide(neuron=10.0, whole=whole, random=5.0)["verdict"] == verdict


def test_a_dense_problem_has_no_expert_placement():
    with pytest.raises(ValueError, match="experts"):
        mep.expert_problem(Affinity([np.ones((G, I))], []))


def test_trimming_drops_each_experts_lightest_neurons_until_l_divides_its_width():
    rng = np.random.default_rng(3)
    size = 7  # 7 % 3 = 1: one neuron per expert goes
    up = [rng.random((G, E * size)) + 1.0 for _ in range(2)]
    down = [rng.random((E * size, G)) + 1.0]
    light = [(e * size + (e % size)) for e in range(E)]  # in expert e, neuron e mod 7 carries almost nothing
    for i, m in enumerate(up):
        m[:, light] = 1e-6
        if i < len(down):
            down[i][light, :] = 1e-6
    problem = Affinity(up, down, experts=E)
    cut, dropped = mep.trimmed(problem, L)
    kept = [k for k in range(E * size) if k not in light]
    assert isinstance(cut, Affinity) and cut.experts == E and cut.intermediate_size == E * 6
    np.testing.assert_array_equal(cut.up[1], up[1][:, kept])
    np.testing.assert_array_equal(cut.down[0], down[0][kept, :])
    shares = [m[:, light].sum() / m.sum() for m in up] + [down[0][light, :].sum() / down[0].sum()]
    assert dropped == pytest.approx(max(shares), rel=1e-9)
    whole = Affinity(up, down, experts=size)  # 7 experts of 6: L divides the width, nothing is dropped
    assert mep.trimmed(whole, L) == (whole, 0.0)


def test_trimming_a_sparse_edge_keeps_its_unkept_mass():
    rng = np.random.default_rng(4)
    size, n = 7, 2
    units = E * size
    edges: dict[tuple[int, int], object] = {(0, 1): rng.random((G, units)), (1, 2): rng.random((units, G)),
                                            (2, 3): rng.random((G, units))}
    kept = rng.random((units, units)) * (rng.random((units, units)) < 0.5)
    rows, cols = np.nonzero(kept)
    edges[(1, 3)] = SparseEdge(rows.astype(np.int32), cols.astype(np.int32), kept[rows, cols], (units, units),
                               float(kept.sum()) + 10.0)  # 10 of its mass not kept
    cut, _ = mep.trimmed(ScheduleAffinity("dtp:2", n, G, units, edges, experts=E), L)
    assert isinstance(cut, ScheduleAffinity) and cut.intermediate_size == E * 6
    sparse = cut.edges[(1, 3)]
    assert isinstance(sparse, SparseEdge) and sparse.shape == (E * 6, E * 6)
    assert sparse.total - float(sparse.values.sum()) == pytest.approx(10.0)
