"""J_σ and its optimiser (issues 20, 29) against slow literal transcriptions of the issues' formulas.

The literal J_σ below reads the schedule's table (b_m, a_m) itself and loops over module pairs, units
and devices; it does not call `schedule_pairs` or anything of `models.optimise`. Under issue 29's damage
weighting an edge m → t is divided by the raw mass of the paper's edge into t, (t-1, t), when that is an
edge of the schedule (else by the mean mass of t's edges); under unit weighting by its own mass.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from models.optimise import block_improvement as schedule_block_improvement
from models.optimise import optimise, score
from models.optimise import optimise as optimise_schedule
from models.optimise import score as schedule_score
from models.optimise.edges import ScheduleAffinity, SparseEdge, Weighting, chain_affinity, schedule_pairs
from models.schedules.grammar import resolve_schedule
from tests.models.optimise.kit import affinity_of, all_balanced, random_layout

LAYERS, GROUPS, NEURONS, DEVICES = 3, 4, 8, 2
PRESETS = ["tp", "dtp:0", "dtp:1", "dtp:2", "dtp:3", "dtp:1@2", "dtp:2@2", "ladder", "spd:1", "spd:0,2",
           "pt:1", "pt:2", "pt:3"]


def units(n: int) -> int:
    return GROUPS if n % 2 == 0 else NEURONS


def every_pair_matrices(seed: int) -> dict[tuple[int, int], np.ndarray]:
    """A heavy-tailed random matrix [U_m, U_t] for every module pair m < t."""
    rng = np.random.default_rng(seed)
    M = 2 * LAYERS
    return {(m, t): rng.lognormal(0.0, 1.5, (units(m), units(t))) for m in range(M) for t in range(m + 1, M)}


def affinity_for_schedule(name: str, full: dict, weighting: Weighting = "damage") -> ScheduleAffinity:
    schedule = resolve_schedule(name, LAYERS, DEVICES)
    return ScheduleAffinity(name, LAYERS, GROUPS, NEURONS, {p: full[p] for p in schedule_pairs(schedule)},
                            weighting)


def is_edge(name: str, m: int, t: int) -> bool:
    """m → t is an edge of J_σ: b_m ≤ t < a_m, read from the schedule's table."""
    schedule = resolve_schedule(name, LAYERS, DEVICES)
    b, a = schedule.own_arrival[m], schedule.other_arrival[m]
    return m < t and b <= t and (a is None or t < a)


def literal_divisor(name: str, full: dict, m: int, t: int, weighting: str) -> float:
    """Unit: the edge's own mass. Damage: the mass of the paper's edge into t when it is an edge, else the
    mean mass of t's edges."""
    if weighting == "unit":
        return float(full[(m, t)].sum())
    if is_edge(name, t - 1, t):
        return float(full[(t - 1, t)].sum())
    into = [float(full[(s, t)].sum()) for s in range(t) if is_edge(name, s, t)]
    return sum(into) / len(into)


def literal_J(name: str, full: dict, heads: np.ndarray, cells: np.ndarray, weighting: str = "damage") -> float:
    """The issues' J_σ: Σ over m < t with b_m ≤ t < a_m of the co-located affinity over its divisor."""
    M = 2 * LAYERS
    total = 0.0
    for m in range(M):
        for t in range(m + 1, M):
            if not is_edge(name, m, t):
                continue
            matrix = full[(m, t)]
            mass = literal_divisor(name, full, m, t, weighting)
            dev_m = heads[m // 2] if m % 2 == 0 else cells[m // 2]
            dev_t = heads[t // 2] if t % 2 == 0 else cells[t // 2]
            for device in range(DEVICES):
                for u in range(units(m)):
                    for v in range(units(t)):
                        if dev_m[u] == device and dev_t[v] == device:
                            total += matrix[u, v] / mass
    return total


def layouts(seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    template = affinity_of(LAYERS, GROUPS, NEURONS, seed=0)
    return [random_layout(template, DEVICES, seed + s) for s in range(3)]


@pytest.mark.parametrize("weighting", ["damage", "unit"])
@pytest.mark.parametrize("name", PRESETS)
def test_J_sigma_is_the_literal_sum(name: str, weighting: Weighting) -> None:
    full = every_pair_matrices(seed=len(name))
    affinity = affinity_for_schedule(name, full, weighting)
    for heads, cells in layouts(seed=7):
        expected = literal_J(name, full, heads, cells, weighting)
        got = schedule_score(affinity, heads, cells, devices=DEVICES).J
        assert got == pytest.approx(expected, rel=1e-12, abs=1e-12)
        if name in ("tp", "dtp:0", "ladder"):  # a_n = b_n for every n: the layout does not matter
            assert got == 0.0 and affinity.layout_independent


def test_dtp1_J_sigma_is_todays_J() -> None:
    for seed in range(4):
        chain = affinity_of(4, 8, 32, seed=seed)
        sigma = chain_affinity(chain.up, chain.down)
        assert sorted(sigma.edges) == schedule_pairs(resolve_schedule("dtp:1", 4, 2))
        for devices in (2, 4):
            for heads, cells in (random_layout(chain, devices, s) for s in range(5)):
                today = score(chain, heads, cells, devices=devices)
                new = schedule_score(sigma, heads, cells, devices=devices)
                assert abs(new.J - today.J) <= 1e-9
                assert new.up_fraction == pytest.approx(today.up_fraction, abs=1e-12)
                assert new.down_fraction == pytest.approx(today.down_fraction, abs=1e-12)
                assert new.upper_bound == pytest.approx(today.upper_bound, abs=1e-12)


@pytest.mark.parametrize(("maximise", "move_heads", "move_neurons", "restarts"),
                         [(True, True, True, 0), (True, True, True, 3), (False, True, True, 0),
                          (True, False, True, 0), (True, True, False, 2)])
def test_dtp1_optimiser_returns_todays_layouts(maximise: bool, move_heads: bool, move_neurons: bool,
                                               restarts: int) -> None:
    for seed, (layers, groups, neurons, devices) in enumerate([(4, 8, 64, 4), (3, 6, 24, 3), (3, 8, 48, 2)]):
        chain = affinity_of(layers, groups, neurons, seed=seed)
        options = dict(maximise=maximise, move_heads=move_heads, move_neurons=move_neurons, restarts=restarts)
        today = optimise(chain, devices, **options)
        new = optimise_schedule(chain_affinity(chain.up, chain.down), devices, **options)
        np.testing.assert_array_equal(new.kv_group_device, today.kv_group_device)
        np.testing.assert_array_equal(new.neuron_device, today.neuron_device)
        assert new.sweeps == today.sweeps
        assert abs(new.report.J - today.report.J) <= 1e-9


@pytest.mark.parametrize("name", PRESETS)
def test_optimiser_output_is_a_brute_force_fixed_point(name: str) -> None:
    """No single balanced reassignment of one layer's KV groups or neurons improves the literal J_σ."""
    full = every_pair_matrices(seed=3 + len(name))
    affinity = affinity_for_schedule(name, full)
    result = optimise_schedule(affinity, DEVICES, restarts=1)
    heads, cells = np.array(result.kv_group_device), np.array(result.neuron_device)
    best = literal_J(name, full, heads, cells)
    assert pytest.approx(best, abs=1e-12) == result.report.J
    if affinity.layout_independent:
        assert best == 0.0 and result.report.layout_independent
        return
    for i in range(LAYERS):
        for row in all_balanced(NEURONS, DEVICES):
            trial = cells.copy()
            trial[i] = row
            assert literal_J(name, full, heads, trial) <= best + 1e-12
        for row in all_balanced(GROUPS, DEVICES):
            trial = heads.copy()
            trial[i] = row
            assert literal_J(name, full, trial, cells) <= best + 1e-12
    assert schedule_block_improvement(affinity, heads, cells) <= 1e-12
    assert best <= result.report.upper_bound + 1e-12


@pytest.mark.parametrize("weighting", ["damage", "unit"])
def test_top_rows_edges(weighting: Weighting) -> None:
    """A top-k edge scores as its kept entries over the dense mass; k = all columns is the dense edge."""
    full = every_pair_matrices(seed=11)
    dense = affinity_for_schedule("dtp:2", full, weighting)
    nn = [p for p in dense.edges if p[0] % 2 and p[1] % 2]
    assert nn  # dtp:2 has neuron → neuron edges
    whole = ScheduleAffinity("dtp:2", LAYERS, GROUPS, NEURONS,
                             {p: SparseEdge.top_k(m, NEURONS) if p in nn else m for p, m in dense.edges.items()},
                             weighting)
    a, b = optimise_schedule(dense, DEVICES), optimise_schedule(whole, DEVICES)
    np.testing.assert_array_equal(a.neuron_device, b.neuron_device)
    assert pytest.approx(b.report.J, abs=1e-12) == a.report.J
    sparse = ScheduleAffinity("dtp:2", LAYERS, GROUPS, NEURONS,
                              {p: SparseEdge.top_k(m, 3) if p in nn else m for p, m in dense.edges.items()},
                              weighting)
    for heads, cells in layouts(seed=1):
        expected = 0.0
        for (m, t), matrix in dense.edges.items():
            kept = matrix.copy()
            if (m, t) in nn:  # literally: zero all but the 3 largest of each row
                for r in range(matrix.shape[0]):
                    kept[r, np.argsort(matrix[r])[:-3]] = 0.0
            dev_m = heads[m // 2] if m % 2 == 0 else cells[m // 2]
            dev_t = heads[t // 2] if t % 2 == 0 else cells[t // 2]
            expected += sum(kept[u, v] for u, v in itertools.product(range(kept.shape[0]), range(kept.shape[1]))
                            if dev_m[u] == dev_t[v]) / literal_divisor("dtp:2", full, m, t, weighting)
        assert pytest.approx(expected, abs=1e-12) == schedule_score(sparse, heads, cells, devices=DEVICES).J
    report = schedule_score(sparse, *layouts(seed=2)[0], devices=DEVICES)
    kept = [e["kept_mass"] for e in report.edges if "kept_mass" in e]
    assert len(kept) == len(nn) and all(0 < k < 1 for k in kept)
    result = optimise_schedule(sparse, DEVICES)
    assert schedule_block_improvement(sparse, result.kv_group_device, result.neuron_device) <= 1e-12
    assert result.report.upper_bound + 1e-12 >= result.report.J


def test_top_rows_bound_is_valid_and_the_relaxed_bound_of_the_kept_entries() -> None:
    """Bound of a top-k edge: no balanced pair of assignments beats it (all enumerated), and it is the
    literal relaxed bound (each unit's largest shares) of the kept entries written densely."""
    from models.optimise.bound import _one_edge_bound

    rng = np.random.default_rng(5)
    matrix = rng.lognormal(0.0, 1.5, (NEURONS, NEURONS))
    top = SparseEdge.top_k(matrix, 3)
    unit = top.scaled(top.total)
    value, exact = _one_edge_bound(unit, DEVICES, 20000)
    kept = unit.dense()
    per_row = sum(sum(sorted(row)[-NEURONS // DEVICES:]) for row in kept.tolist())
    per_col = sum(sum(sorted(col)[-NEURONS // DEVICES:]) for col in kept.T.tolist())
    assert not exact and pytest.approx(min(per_row, per_col, kept.sum()), abs=1e-12) == value
    rows = all_balanced(NEURONS, DEVICES)
    best = max(float(np.where(a[:, None] == b[None, :], kept, 0.0).sum()) for a in rows for b in rows)
    assert best <= value + 1e-12
