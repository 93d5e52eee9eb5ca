"""Model families, looked up by `config.model_type`.

Each family is one small module declaring its sharding plan (which linears are column- or
row-parallel, by KV group or by neuron; `models/families/plan.py`) and which configurations it
refuses. Permutation, simulation, export and the runtime all derive from the plan.
"""

from models.families.base import (
    Family,
    UnsupportedModelError,
    family_for_config,
    model_shape,
    supported_model_types,
)
from models.families.plan import LLAMA_PLAN, Colwise, ParallelStyle, PlanError, Rowwise, ShardingPlan

__all__ = [
    "LLAMA_PLAN",
    "Colwise",
    "Family",
    "ParallelStyle",
    "PlanError",
    "Rowwise",
    "ShardingPlan",
    "UnsupportedModelError",
    "family_for_config",
    "model_shape",
    "supported_model_types",
]
