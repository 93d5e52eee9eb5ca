"""Layout optimisation (§3 of the paper, issue 20): one objective J_σ over a schedule's edges — objective (6)
at dtp:1, whose edges are the paper's chain —, its upper bound and one coordinate-ascent optimiser.

    problem.py     the input: the chain's per-layer affinity matrices (`Affinity`, dtp:1) or a schedule's
                   (`ScheduleAffinity`), device counts, the contiguous layout
    edges.py       the edges of J_σ (every m < t with b_m ≤ t < a_m), their matrices (dense or sparse up to a
                   kept mass), their damage weights (issue 29) and the per-edge gains and co-located mass
    assignment.py  the exact transportation solver (n units onto L sinks of fixed capacities)
    objective.py   J_σ (objective (6) at dtp:1) of a layout, with its per-edge co-located fractions (`score`)
    bound.py       the per-edge upper bound of J_σ
    ascent.py      coordinate ascent over the blocks (`optimise`) and its fixed-point test

Every function takes either input (`Problem`). Pure numpy. Every public name is importable from
`models.optimise`.
"""

from models.optimise.ascent import OptimiseResult, block_improvement, is_block_optimal, optimise
from models.optimise.assignment import balanced_assignment, transport
from models.optimise.bound import UpperBound, partition_count, upper_bound
from models.optimise.edges import ScheduleAffinity
from models.optimise.objective import ScoreReport, check_layout, objective, score
from models.optimise.problem import (
    Affinity,
    Problem,
    check_devices,
    contiguous_layout,
    contiguous_row,
    edges_of,
    valid_device_counts,
)

__all__ = [
    "Affinity",
    "OptimiseResult",
    "Problem",
    "ScheduleAffinity",
    "ScoreReport",
    "UpperBound",
    "balanced_assignment",
    "block_improvement",
    "check_devices",
    "check_layout",
    "contiguous_layout",
    "contiguous_row",
    "edges_of",
    "is_block_optimal",
    "objective",
    "optimise",
    "partition_count",
    "score",
    "transport",
    "upper_bound",
    "valid_device_counts",
]
