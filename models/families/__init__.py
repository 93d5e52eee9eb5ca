"""Model families, looked up by `config.model_type`.

Each family is one small module declaring which weights move with a KV group and which with an
FFN neuron (rows of q/k/v/gate/up, columns of o/down) and which configurations it refuses.
"""

from models.families.base import (
    Family,
    UnsupportedModelError,
    family_for_config,
    model_shape,
    supported_model_types,
)

__all__ = [
    "Family",
    "UnsupportedModelError",
    "family_for_config",
    "model_shape",
    "supported_model_types",
]
