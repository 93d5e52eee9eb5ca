"""What every supported family shares: a pre-norm decoder with RMSNorm, grouped-query attention
and a SwiGLU FFN, in the Llama module layout (`model.layers[i].self_attn.{q,k,v,o}_proj`,
`model.layers[i].mlp.{gate,up,down}_proj`); and the record (`Family`) in which each family module
declares everything the project knows about it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from models.families.moe import MoeFfn
from models.families.plan import LLAMA_PLAN, ShardingPlan


class UnsupportedModelError(ValueError):
    """The model's architecture is outside what DTP layouts are defined for."""


@dataclass(frozen=True)
class VllmArchitecture:
    """The family's architecture in the vLLM plugin (models.serving.vllm): the class the plugin registers and
    the vLLM architecture it stands in for (the one vLLM would run the family's plain checkpoint as)."""

    dtp: str  # e.g. "DtpLlamaForCausalLM": the class's name, named in shards/config.json
    replaces: str  # e.g. "LlamaForCausalLM": vLLM's own class for the family
    # the module of the plugin that defines `dtp` (imported by vLLM alone: it imports vLLM's model code)
    module: str = "models.serving.vllm.model"

    def __post_init__(self) -> None:
        if not self.module.startswith("models.serving.vllm."):
            raise ValueError(f"vllm.module={self.module!r}: the DTP class must live in the plugin package "
                             "(a module under models.serving.vllm.)")

    @property
    def class_path(self) -> str:
        """What vLLM's ModelRegistry.register_model takes: `module:Class`, imported lazily by vLLM."""
        return f"{self.module}:{self.dtp}"


@dataclass(frozen=True, kw_only=True)
class Family:
    """One family, declared once in its module and registered in `models.families.registry`: every fact a
    consumer needs (loading, the simulator, the memory plan, the API's defaults, the serving manifest, the
    vLLM plugin) is read from here, never from the model type's name.

    A fact that only some families have (a mixture-of-experts FFN, say) is a new field with a default
    here that the other families leave out.
    """

    name: str
    model_types: tuple[str, ...]
    # transformers' class names for the family: what AutoModelForCausalLM builds from its config
    # (never trust_remote_code: the class is transformers' own) and the config class.
    hf_class: str
    hf_config_class: str
    # The family's class in the vLLM plugin; None: not served by the plugin (yet): layouts, the simulator and
    # the runtime work, `vllm-serve` refuses it.
    vllm: VllmArchitecture | None
    # Which linears are column-/row-parallel by KV group or by neuron; everything else is replicated.
    plan: ShardingPlan = LLAMA_PLAN
    # q, k and v always carry biases (Qwen2): column-parallel, their rows move with the KV group. Counted in
    # the parameter count and the memory plan (each [q or kv width] per layer).
    qkv_bias: bool = False
    # Qwen3 normalises q and k per head with one shared gain ([head_dim] each per layer): commutes with any
    # head order; the simulator and the runtime apply it, the counts add it.
    qk_norm: bool = False
    # What the family's config class fills in for a field a config leaves out (models.families.defaults).
    config_defaults: Mapping[str, Any] = field(default_factory=dict)
    # Keys the config class also stores a field under (its attribute_map, read the other way): alias -> field.
    # transformers 5 saves Qwen3-MoE's num_experts as num_local_experts; a config.json read as a dict must not
    # then take num_experts from config_defaults (128 experts for 8).
    config_aliases: Mapping[str, str] = field(default_factory=dict)
    # Extra refusals on top of the common ones: returns a reason, or None if the config is fine.
    extra_check: Callable[[Any], str | None] | None = None
    # A mixture-of-experts FFN in every layer (issue 46; models.families.moe): its config fields, router and
    # checkpoint names. None: the dense SwiGLU FFN of the plan.
    moe: MoeFfn | None = None

    def __post_init__(self) -> None:
        if not self.model_types:
            raise ValueError(f"family {self.name!r}: model_types is empty (give the config model_type(s) it covers)")
        object.__setattr__(self, "config_defaults", MappingProxyType(dict(self.config_defaults)))
        object.__setattr__(self, "config_aliases", MappingProxyType(dict(self.config_aliases)))

    def refusals(self, config: Any) -> list[str]:
        """Why this family cannot run `config` under DTP (the common reasons, then its own); empty if it can."""
        reasons = _common_refusals(config, moe=self.moe is not None)
        if self.moe is not None:
            reasons += self.moe.refusals(config)
        if self.extra_check is not None and (extra := self.extra_check(config)):
            reasons.append(extra)
        return reasons


# What a Llama-layout config class fills in for an omitted field (LlamaConfig's; the other families
# start from it). None is derived by the class: kv heads = attention heads, head_dim = hidden / heads.
LLAMA_DEFAULTS: Mapping[str, Any] = MappingProxyType({
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048,
    "tie_word_embeddings": False, "hidden_act": "silu",
})


def refuse_attention_bias(config: Any) -> str | None:
    """Llama's and Qwen3's `attention_bias` also puts a bias on o_proj (row-parallel): refused."""
    if getattr(config, "attention_bias", False):
        return "attention_bias=True (it also puts a bias on o_proj, which has no owning device under DTP)"
    return None


def _common_refusals(config: Any, *, moe: bool = False) -> list[str]:
    reasons = []
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        reasons.append(f"hidden_act={act!r} (the SwiGLU gate must be 'silu')")
    if getattr(config, "mlp_bias", False):
        reasons.append("mlp_bias=True (a down_proj bias has no owning device under DTP)")
    for key in () if moe else ("num_experts", "num_local_experts", "n_routed_experts"):
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

