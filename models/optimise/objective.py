"""J_σ, the layout objective of a communication schedule, and its report; at dtp:1 objective (6) of the paper.

A layout puts KV group g of layer i on device h_i(g) and FFN neuron k on device ν_i(k), balanced
(G/L groups and I/L neurons per device). With S_e the raw first-order damage of edge e = (m, t), E_e its
mass, f_e(layout) = Σ_{u ∈ m, v ∈ t: dev(u) = dev(v)} S_e[u, v] / E_e its co-located fraction and
E_ref(t) the mass of the paper's edge into t, (t-1, t) (`ScheduleAffinity.reference_mass`),

    J_σ(layout) = Σ_{(m, t) edges of σ}  w_e · f_e(layout),   w_e = E_e / E_ref(t)            (issue 29)

over the edges of `models.optimise.edges`: each receiving module's co-located damage in units of its
paper's edge's. At dtp:1 every edge is a paper's edge (w_e = 1) and the edges are the chain (an `Affinity`):

    J = Σ_i Σ_{g,k: h_i(g)=ν_i(k)} Ŝup_i[g, k] + Σ_{i<N-1} Σ_{k,g: ν_i(k)=h_{i+1}(g)} Ŝdown_i[k, g],   (6)

in [0, 2N-1]; a uniformly random layout scores Σ_e w_e · kept_e / L in expectation ((2N-1)/L at dtp:1;
kept_e < 1 only for a sparse edge). `weighting="unit"` sets every w_e = 1 (issue 20's J_σ). tp and
ladder have no edge and J_σ = 0 for every layout. Pure numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models.optimise.bound import UpperBound, upper_bound
from models.optimise.edges import Pair, ScheduleAffinity, co_located, edge_kind, edge_name, module_devices
from models.optimise.problem import Affinity, Problem, check_devices, edges_of, neuron_blocks


def check_layout(affinity: Problem, kv_group_device: Any, neuron_device: Any,
                 devices: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    """The device arrays as int64 [N, G] and [N, I] and L; ValueError unless balanced over L devices."""
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
    blocks = neuron_blocks(affinity)
    if blocks > 1:  # an MoE model: every expert balanced on its own (issue 46)
        size = neurons // blocks
        per_expert = np.stack([np.bincount(row, minlength=devices) for row in cells.reshape(-1, size)])  # [N·E, L]
        bad = np.flatnonzero((per_expert != size // devices).any(axis=1))
        if bad.size:
            i, e = divmod(int(bad[0]), blocks)
            raise ValueError(f"neuron_device[{i}]: expert {e} unbalanced, per-device counts "
                             f"{per_expert[bad[0]].tolist()}, expected {size // devices} of its {size} neurons on "
                             f"each of {devices} devices")
    return heads.astype(np.int64), cells.astype(np.int64), int(devices)


def edge_fractions(unit: ScheduleAffinity, heads: np.ndarray, cells: np.ndarray) -> dict[Pair, float]:
    """The co-located mass of every edge of `unit` (a fraction for a normalised affinity, w_e · f_e for a
    weighted one), in edge order."""
    return {pair: co_located(matrix, module_devices(heads, cells, pair[0]), module_devices(heads, cells, pair[1]))
            for pair, matrix in unit.edges.items()}


def objective(unit: Problem, heads: np.ndarray, cells: np.ndarray) -> float:
    """J_σ of checked [N, G] / [N, I] device arrays over a weighted affinity (J of (6) for a chain)."""
    return float(sum(edge_fractions(edges_of(unit), heads, cells).values()))


@dataclass(frozen=True)
class ScoreReport:
    """J_σ of a layout with its per-edge co-located fractions, the random expectation and the upper bound.

    up_fraction / down_fraction: the chain's edges (layer i's up, layer i's down), None where the schedule
    lacks them. `schedule` is None for the paper's chain (an `Affinity`), whose `as_dict` keeps the keys
    of objective (6)'s report; a schedule's also names the schedule and lists every edge.
    """

    J: float
    devices: int
    random_expectation: float
    up_fraction: list[float | None]
    down_fraction: list[float | None]
    upper_bound: float
    upper_bound_exact: bool
    schedule: str | None = None
    edges: list[dict[str, Any]] = field(default_factory=list)  # {"from", "to", "name", "kind", "fraction",
    #                                   "upper_bound" (fractions), "mass", "weight", "term", ["kept_mass"]}
    layout_independent: bool = False
    weighting: str = "damage"
    kept_mass: float | None = None  # the least kept mass of a sparse edge; None: every edge dense

    def as_dict(self) -> dict[str, Any]:
        head: dict[str, Any] = {"J": self.J, "devices": self.devices, "random_expectation": self.random_expectation}
        per_edge: dict[str, Any] = {}
        if self.schedule is not None:
            head |= {"schedule": self.schedule, "layout_independent": self.layout_independent,
                     "weighting": self.weighting, "kept_mass": self.kept_mass}
            per_edge = {"edges": [dict(e) for e in self.edges]}
        return {**head, "up_fraction": list(self.up_fraction), "down_fraction": list(self.down_fraction),
                **per_edge, "upper_bound": self.upper_bound, "upper_bound_exact": self.upper_bound_exact}


def score(affinity: Problem, kv_group_device: Any, neuron_device: Any, *, devices: int | None = None,
          bound: UpperBound | None = None) -> ScoreReport:
    """J_σ (objective (6) for a chain) of a balanced layout, its per-edge fractions and the upper bound.

    kv_group_device: [N, G] ints; neuron_device: [N, I] ints. `devices` defaults to the largest id + 1.
    The random expectation is Σ_e w_e · kept_e / L: (2N-1)/L for a chain unless an edge is all zero.
    Per edge the report gives its co-located `fraction`, the bound of that fraction, its raw `mass`, its
    `weight` w_e and its `term` w_e · fraction in J_σ.
    """
    heads, cells, devices = check_layout(affinity, kv_group_device, neuron_device, devices)
    sigma = edges_of(affinity)
    fractions = edge_fractions(sigma.normalised(), heads, cells)
    terms = edge_fractions(sigma.weighted(), heads, cells)
    if bound is None:
        bound = upper_bound(affinity, devices)
    elif bound.devices != devices:
        raise ValueError(f"bound was computed for L={bound.devices} devices, the layout has L={devices}")
    kept, weights, masses = sigma.kept_mass(), sigma.weights(), sigma.edge_masses()
    edges = []
    for pair, fraction in fractions.items():
        w = weights[pair]
        row: dict[str, Any] = {"from": pair[0], "to": pair[1], "name": edge_name(pair), "kind": edge_kind(pair),
                               "fraction": fraction, "upper_bound": bound.edges[pair] / w if w > 0 else 0.0,
                               "mass": masses[pair], "weight": w, "term": terms[pair]}
        if pair in kept:
            row["kept_mass"] = kept[pair]
        edges.append(row)
    n = sigma.num_layers
    return ScoreReport(
        J=float(sum(terms.values())), devices=devices,
        random_expectation=float(sum(weights[p] * kept.get(p, 1.0) for p in sigma.edges) / devices),
        up_fraction=[fractions.get((2 * i, 2 * i + 1)) for i in range(n)],
        down_fraction=[fractions.get((2 * i + 1, 2 * i + 2)) for i in range(n - 1)],
        upper_bound=bound.value, upper_bound_exact=bound.exact,
        schedule=None if isinstance(affinity, Affinity) else sigma.schedule, edges=edges,
        layout_independent=sigma.layout_independent, weighting=sigma.weighting,
        kept_mass=min(kept.values()) if kept else None)
