"""Layout optimisation (§3 of the paper): objective (6), its upper bound and the chain optimiser.

    problem.py     the input: per-layer affinity matrices, device counts, the contiguous layout
    assignment.py  the exact transportation solver (n units onto L sinks of fixed capacities)
    objective.py   J of a layout, with its per-edge co-located fractions (`score`)
    bound.py       the per-edge upper bound of J
    ascent.py      coordinate ascent over the chain's blocks (`optimise`) and its fixed-point test

Pure numpy. Every public name is importable from `models.optimise`.
"""

from models.optimise.ascent import OptimiseResult, block_improvement, is_block_optimal, optimise
from models.optimise.assignment import balanced_assignment, transport
from models.optimise.bound import UpperBound, partition_count, upper_bound
from models.optimise.objective import ScoreReport, check_layout, objective, score
from models.optimise.problem import Affinity, check_devices, contiguous_layout, contiguous_row, valid_device_counts

__all__ = [
    "Affinity",
    "OptimiseResult",
    "ScoreReport",
    "UpperBound",
    "balanced_assignment",
    "block_improvement",
    "check_devices",
    "check_layout",
    "contiguous_layout",
    "contiguous_row",
    "is_block_optimal",
    "objective",
    "optimise",
    "partition_count",
    "score",
    "transport",
    "upper_bound",
    "valid_device_counts",
]
