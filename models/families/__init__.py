"""Model families, looked up by `config.model_type`.

Each family is one small module declaring its record (`Family`, base.py): its model types, its
transformers and vLLM class names, its sharding plan (which linears are column- or row-parallel, by KV
group or by neuron; `models/families/plan.py`), its q/k/v biases and q/k norms, its config defaults and
which configurations it refuses; `registry.py` lists the registered ones. Permutation, simulation,
export and the runtime all derive from the plan; the memory plan, the API's defaults, the serving
manifest and the vLLM plugin from the record.
"""

from models.families.base import Family, UnsupportedModelError, VllmArchitecture
from models.families.plan import LLAMA_PLAN, Colwise, ParallelStyle, PlanError, Rowwise, ShardingPlan
from models.families.registry import FAMILIES, family_for_config, find_family, model_shape, supported_model_types

__all__ = [
    "FAMILIES",
    "LLAMA_PLAN",
    "Colwise",
    "Family",
    "ParallelStyle",
    "PlanError",
    "Rowwise",
    "ShardingPlan",
    "UnsupportedModelError",
    "VllmArchitecture",
    "family_for_config",
    "find_family",
    "model_shape",
    "supported_model_types",
]
