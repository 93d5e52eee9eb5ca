"""The probe's K candidate layouts, in the order they are taken (the first K distinct ones):

    optimised         the schedule's J_σ-optimised layout (the job's own `optimised`)
    dtp1-optimised    optimised on the paper's chain objective (J_σ of dtp:1)
    mix-0.5           optimised on 0.5·J_σ + 0.5·J_dtp:1
    optimised-seed1   J_σ again, the optimiser's random restarts drawn with seed 1
    mix-0.25, mix-0.75, optimised-seed2, optimised-seed3, …

Where the run's objective is the chain itself (δ ≤ 1, spd:B) the chain and mixture candidates are the optimised
layout again and are not taken: the candidates are restarts. A candidate equal to an earlier one up to a
relabelling of the devices is dropped and the next one taken. Every candidate is scored in the run's J_σ
(both units, like every layout of the run) and records how it was built (`candidate` in its score). Pure numpy.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from models.layouts.layout import Layout
from models.optimise import optimise, upper_bound
from models.optimise.edges import EdgeMatrix, ScheduleAffinity, SparseEdge, scaled
from models.optimise.problem import Problem, edges_of
from models.schedules.grammar import Schedule
from models.variants.set import neuron_agreement, objective_affinity, scored_layout

if TYPE_CHECKING:
    from models.affinity.file import AffinityResult

OPTIMISED = "optimised"
CHAIN = "dtp1-optimised"
MIXTURES = (0.5, 0.25, 0.75)  # the weight of J_σ in the mixture, in the order the candidates take them
MAX_TRIES = 16  # candidates built at most, duplicates included


@dataclass(frozen=True)
class Candidate:
    """How one candidate is built: J_σ's weight in its objective (1: J_σ, 0: the chain) and the restarts' seed."""

    name: str
    weight: float
    seed: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"objective_weight": self.weight, "restart_seed": self.seed}


def candidate_order(*, chain_differs: bool) -> Iterator[Candidate]:
    """The candidates in the order a probe takes them (endless: restarts with ever larger seeds)."""
    yield Candidate(OPTIMISED, 1.0)
    if chain_differs:
        yield Candidate(CHAIN, 0.0)
        yield Candidate(f"mix-{MIXTURES[0]:g}", MIXTURES[0])
    yield Candidate(f"{OPTIMISED}-seed1", 1.0, seed=1)
    if chain_differs:
        yield from (Candidate(f"mix-{w:g}", w) for w in MIXTURES[1:])
    seed = 2
    while True:
        yield Candidate(f"{OPTIMISED}-seed{seed}", 1.0, seed=seed)
        seed += 1


def _dense(matrix: EdgeMatrix) -> np.ndarray:
    return matrix.dense() if isinstance(matrix, SparseEdge) else np.asarray(matrix)


def mixture(sigma: ScheduleAffinity, chain: ScheduleAffinity, weight: float) -> ScheduleAffinity:
    """The affinity whose J is weight·J_σ + (1 − weight)·J_dtp:1: each edge as J_σ sums it (S_e / E_ref(t)) times
    `weight`, plus the chain's (unit mass) times 1 − weight. Exact where every receiver of the chain receives
    the paper's edge in σ too (every dtp:δ, δ ≥ 1: the paper's edge into t then has mass 1 in the mixture, so
    J's own division by it changes nothing); elsewhere each receiver is rescaled to its paper edge."""
    if not 0 < weight < 1:
        raise ValueError(f"a mixture's weight must be in (0, 1), got {weight}")
    ours, theirs = sigma.weighted().edges, chain.weighted().edges
    edges: dict[tuple[int, int], EdgeMatrix] = {}
    for pair in sorted(set(ours) | set(theirs)):
        if pair in ours and pair in theirs:  # a paper's edge: dense in both
            edges[pair] = weight * _dense(ours[pair]) + (1 - weight) * _dense(theirs[pair])
        elif pair in ours:
            edges[pair] = scaled(ours[pair], 1 / weight)
        else:
            edges[pair] = scaled(theirs[pair], 1 / (1 - weight))
    return ScheduleAffinity(f"mix-{weight:g}", sigma.num_layers, sigma.num_kv_groups, sigma.intermediate_size, edges)


def _problem(result: AffinityResult, score_name: str, schedule: Schedule | None, weight: float) -> Problem:
    if weight == 1.0:
        return objective_affinity(result, score_name, schedule)
    chain = objective_affinity(result, score_name, None)
    if weight == 0.0:
        return chain
    assert schedule is not None, "a mixture needs a schedule other than the chain"
    return mixture(edges_of(objective_affinity(result, score_name, schedule)), edges_of(chain), weight)


def _same(a: Layout, b: Layout) -> bool:
    agree = neuron_agreement(a, b)
    return bool(agree["neurons"] == 1.0 and agree["kv_groups"] == 1.0)


def probe_candidates(result: AffinityResult, *, count: int, devices: int, delta: int, score_name: str,
                     schedule: Schedule | None, restarts: int, optimised: Layout | None = None) -> dict[str, Layout]:
    """The first `count` distinct candidates (fewer when MAX_TRIES builds find no more), each scored in the run's
    J_σ. `schedule`: the run's objective (None: the chain). `optimised`: the run's own optimised layout, taken as
    it is. Restart candidates use max(restarts, 1) restarts (with none every seed starts from contiguous alone)."""
    chain_differs = schedule is not None and not _is_chain(result, score_name, schedule)
    recorded = None if schedule is None else str(schedule)
    out: dict[str, Layout] = {}
    for tries, candidate in enumerate(candidate_order(chain_differs=chain_differs)):
        if len(out) == count or tries == MAX_TRIES:
            break
        if candidate.name == OPTIMISED and optimised is not None:
            lay = optimised.with_name(OPTIMISED)
        else:
            problem = _problem(result, score_name, schedule, candidate.weight)
            starts = restarts if candidate.seed == 0 else max(restarts, 1)
            best = optimise(problem, devices, bound=upper_bound(problem, devices), restarts=starts,
                            seed=candidate.seed)
            lay = Layout(candidate.name, devices, delta, result.shape, best.kv_group_device, best.neuron_device,
                         schedule=recorded)
            lay = scored_layout(lay, result, score_name=score_name, objective=score_name, restarts=starts,
                                schedule=schedule)
        if any(_same(lay, earlier) for earlier in out.values()):
            continue
        out[candidate.name] = lay.with_name(candidate.name, {**(lay.score or {}), "candidate": candidate.as_dict()})
    return out


def _is_chain(result: AffinityResult, score_name: str, schedule: Schedule) -> bool:
    """Whether the schedule's edges are the chain's own (J_σ = J_dtp:1: no mixture differs from either)."""
    ours = set(edges_of(objective_affinity(result, score_name, schedule)).edges)
    return ours == set(edges_of(objective_affinity(result, score_name, None)).edges)
