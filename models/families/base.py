"""What every supported family shares: a pre-norm decoder with RMSNorm, grouped-query attention
and a SwiGLU FFN, in the Llama module layout (`model.layers[i].self_attn.{q,k,v,o}_proj`,
`model.layers[i].mlp.{gate,up,down}_proj`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from models.families.plan import ShardingPlan
from models.layouts.layout import ModelShape


class UnsupportedModelError(ValueError):
    """The model's architecture is outside what DTP layouts are defined for."""


@dataclass(frozen=True)
class Family:
    """One family: the model types it covers, how its linears shard, and what it refuses."""

    name: str
    model_types: tuple[str, ...]
    # Which linears are column-/row-parallel by KV group or by neuron; everything else is replicated.
    plan: ShardingPlan
    # Qwen3 normalises q and k per head with one shared gain: commutes with any head order.
    qk_norm: bool = False
    # Extra refusals on top of the common ones: returns a reason, or None if the config is fine.
    extra_check: Callable[[Any], str | None] | None = None


_FAMILY_MODULES = ("llama", "mistral", "qwen2", "qwen3")


def _registry() -> dict[str, Family]:
    families: dict[str, Family] = {}
    for mod in _FAMILY_MODULES:
        family: Family = importlib.import_module(f"models.families.{mod}").FAMILY
        for model_type in family.model_types:
            families[model_type] = family
    return families


def supported_model_types() -> list[str]:
    return sorted(_registry())


def _common_refusals(config: Any) -> list[str]:
    reasons = []
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        reasons.append(f"hidden_act={act!r} (the SwiGLU gate must be 'silu')")
    if getattr(config, "mlp_bias", False):
        reasons.append("mlp_bias=True (a down_proj bias has no owning device under DTP)")
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(config, key, None):
            reasons.append(f"{key}={getattr(config, key)} (mixture-of-experts FFNs)")
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        kinds = sorted(set(layer_types))
        reasons.append(f"layer_types={kinds} (only 'full_attention' layers; sliding-window is refused)")
    if getattr(config, "use_sliding_window", False):
        reasons.append("use_sliding_window=True (sliding-window attention)")
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or 0
    if kv <= 0 or heads % kv:
        reasons.append(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    return reasons


def family_for_config(config: Any) -> Family:
    """The family for a transformers config, or UnsupportedModelError naming what was found."""
    model_type = getattr(config, "model_type", None)
    registry = _registry()
    if model_type not in registry:
        raise UnsupportedModelError(
            f"model_type={model_type!r} is not supported; supported model types: "
            f"{', '.join(supported_model_types())} (pre-norm RMSNorm decoders with grouped-query "
            "attention and a SwiGLU FFN)"
        )
    family = registry[model_type]
    reasons = _common_refusals(config)
    if family.extra_check is not None and (extra := family.extra_check(config)):
        reasons.append(extra)
    if reasons:
        raise UnsupportedModelError(
            f"{model_type} model not supported: " + "; ".join(reasons)
            + f". Supported: {', '.join(supported_model_types())} with full causal attention, "
            "SiLU-gated FFN, no row-parallel (o_proj/down_proj) biases, no MoE."
        )
    return family


def model_shape(config: Any) -> ModelShape:
    """The dimensions a layout is defined over."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelShape(
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        num_kv_groups=config.num_key_value_heads,
        num_query_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        hidden_size=config.hidden_size,
        head_dim=head_dim,
    )
