"""Mixtral (transformers `MixtralForCausalLM`): the Llama attention and a routed-expert FFN in every layer
(`models.families.moe`), top-k weights always renormalised; `intermediate_size` is one expert's width.
Refused: a sliding window that can mask anything, router jitter (training noise)."""

from typing import Any

from models.families.base import LLAMA_DEFAULTS, Family, VllmArchitecture
from models.families.moe import ExpertNames, MoeFfn
from models.families.plan import ATTENTION_PLAN


def _check(config: Any) -> str | None:
    window = getattr(config, "sliding_window", None)
    # A window at least as long as the context never masks anything: that model is full attention.
    if window is not None and window < config.max_position_embeddings:
        return (f"sliding_window={window} < max_position_embeddings={config.max_position_embeddings} "
                "(sliding-window attention; null is accepted)")
    return None


FAMILY = Family(
    name="mixtral",
    model_types=("mixtral",),
    hf_class="MixtralForCausalLM",
    hf_config_class="MixtralConfig",
    vllm=VllmArchitecture(dtp="DtpMixtralForCausalLM", replaces="MixtralForCausalLM"),
    plan=ATTENTION_PLAN,
    config_aliases={"num_experts": "num_local_experts"},  # MixtralConfig.attribute_map
    moe=MoeFfn(num_experts_field="num_local_experts", expert_size_field="intermediate_size",
               checkpoint=ExpertNames(router="block_sparse_moe.gate.weight",
                                      gate="block_sparse_moe.experts.{e}.w1.weight",
                                      up="block_sparse_moe.experts.{e}.w3.weight",
                                      down="block_sparse_moe.experts.{e}.w2.weight")),
    # MixtralConfig's own defaults
    config_defaults={**LLAMA_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8,
                     "max_position_embeddings": 131072, "sliding_window": None, "num_local_experts": 8,
                     "num_experts_per_tok": 2, "router_jitter_noise": 0.0},
    extra_check=_check,
)
