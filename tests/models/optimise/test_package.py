"""models.optimise: the names callers used from the single module still import from the package."""

from __future__ import annotations

import models.optimise as O

FORMER_NAMES = [
    "Affinity", "OptimiseResult", "ScoreReport", "UpperBound", "balanced_assignment", "block_improvement",
    "check_devices", "contiguous_layout", "contiguous_row", "is_block_optimal", "optimise", "partition_count",
    "score", "upper_bound", "valid_device_counts"
]


def test_former_names_import_from_the_package():
    assert set(FORMER_NAMES) <= set(O.__all__)
    for name in O.__all__:
        exec(f"from models.optimise import {name}", {})
