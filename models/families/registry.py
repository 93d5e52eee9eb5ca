"""The supported families: one registration each (`FAMILIES`), looked up by `config.model_type`; the shape a
layout is defined over (`model_shape`, which reads the record of an MoE family).

A new family is its module (a `FAMILY` record, models/families/base.py) plus its line below; every
consumer (loading and the refusals, the simulator, the memory plan, the API's config defaults, the serving
manifest's architecture, the vLLM plugin's registration) reads the record from here.
tests/models/test_family_registry.py walks `FAMILIES` and checks that each consumer finds every family.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from models.base.shapes import ModelShape
from models.families import llama, mistral, mixtral, qwen2, qwen3, qwen3_moe
from models.families.base import Family, UnsupportedModelError

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    mistral.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    qwen3_moe.FAMILY,
    mixtral.FAMILY,
)


def _by_model_type(families: tuple[Family, ...]) -> Mapping[str, Family]:
    """model_type -> family, refusing two records that claim one model type, name or DTP class."""
    out: dict[str, Family] = {}
    for attr in ("name", "hf_class"):
        values = [getattr(f, attr) for f in families]
        if len(set(values)) != len(values):
            raise ValueError(f"two registered families share a {attr}: {sorted(values)}")
    dtp = [f.vllm.dtp for f in families if f.vllm is not None]
    if len(set(dtp)) != len(dtp):
        raise ValueError(f"two registered families share a vLLM DTP class: {sorted(dtp)}")
    for family in families:
        for model_type in family.model_types:
            if model_type in out:
                raise ValueError(f"model_type {model_type!r} is registered by both {out[model_type].name!r} "
                                 f"and {family.name!r}")
            out[model_type] = family
    return out


_BY_MODEL_TYPE = _by_model_type(FAMILIES)


def supported_model_types() -> list[str]:
    return sorted(_BY_MODEL_TYPE)


def find_family(model_type: Any) -> Family | None:
    """The registered family of `model_type`, or None (no refusals checked: `family_for_config` does that)."""
    return _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None


def family_for_config(config: Any) -> Family:
    """The family for a transformers config, or UnsupportedModelError naming what was found."""
    model_type = getattr(config, "model_type", None)
    family = find_family(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"model_type={model_type!r} is not supported; supported model types: "
            f"{', '.join(supported_model_types())} (pre-norm RMSNorm decoders with grouped-query "
            "attention and a SwiGLU FFN)"
        )
    reasons = family.refusals(config)
    if reasons:
        raise UnsupportedModelError(
            f"{model_type} model not supported: " + "; ".join(reasons)
            + f". Supported: {', '.join(supported_model_types())} with full causal attention, "
            "SiLU-gated FFN, no row-parallel (o_proj/down_proj) biases; mixture-of-experts FFNs in every "
            "layer (qwen3_moe, mixtral), no shared experts."
        )
    return family


def model_shape(config: Any) -> ModelShape:
    """The dimensions a layout is defined over. An MoE family's FFN units are its experts' neurons,
    expert-major: intermediate_size = E·I_e (issue 46, `models.families.moe`)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    family = find_family(getattr(config, "model_type", None))
    if family is not None and family.moe is not None:
        experts, size = family.moe.num_experts(config), family.moe.expert_size(config)
        return ModelShape(
            model_type=config.model_type, num_layers=config.num_hidden_layers,
            num_kv_groups=config.num_key_value_heads, num_query_heads=config.num_attention_heads,
            intermediate_size=experts * size, hidden_size=config.hidden_size, head_dim=head_dim,
            num_experts=experts, experts_per_token=family.moe.experts_per_token(config), expert_size=size)
    return ModelShape(
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        num_kv_groups=config.num_key_value_heads,
        num_query_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        hidden_size=config.hidden_size,
        head_dim=head_dim,
    )
