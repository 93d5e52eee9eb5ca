"""Qwen3-MoE (transformers `Qwen3MoeForCausalLM`): Qwen3's attention (per-head q/k norms) and a routed-expert
FFN in every layer (`models.families.moe`); no shared expert. Refused: dense FFN layers mixed in
(`mlp_only_layers`, `decoder_sparse_step` ≠ 1) and attention biases."""

from typing import Any

from models.families.base import LLAMA_DEFAULTS, Family, VllmArchitecture, refuse_attention_bias
from models.families.moe import ExpertNames, MoeFfn
from models.families.plan import ATTENTION_PLAN


def _check(config: Any) -> str | None:
    reasons = []
    if getattr(config, "mlp_only_layers", None):
        reasons.append(f"mlp_only_layers={list(config.mlp_only_layers)} (dense FFN layers among the MoE ones; "
                       "only an MoE FFN in every layer is supported: [] is accepted)")
    step = getattr(config, "decoder_sparse_step", 1)
    if step != 1:
        reasons.append(f"decoder_sparse_step={step} (an MoE FFN only every {step} layers, dense ones between; "
                       "1 is accepted)")
    if (bias := refuse_attention_bias(config)) is not None:
        reasons.append(bias)
    return "; ".join(reasons) or None


FAMILY = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    hf_class="Qwen3MoeForCausalLM",
    hf_config_class="Qwen3MoeConfig",
    vllm=VllmArchitecture(dtp="DtpQwen3MoeForCausalLM", replaces="Qwen3MoeForCausalLM"),
    plan=ATTENTION_PLAN,
    qk_norm=True,
    moe=MoeFfn(num_experts_field="num_experts", expert_size_field="moe_intermediate_size",
               norm_topk_prob_field="norm_topk_prob",
               checkpoint=ExpertNames(router="mlp.gate.weight", gate="mlp.experts.{e}.gate_proj.weight",
                                      up="mlp.experts.{e}.up_proj.weight", down="mlp.experts.{e}.down_proj.weight")),
    # Qwen3MoeConfig's own defaults (head_dim is derived: hidden / heads)
    config_defaults={**LLAMA_DEFAULTS, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                     "num_hidden_layers": 24, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                     "use_sliding_window": False, "attention_bias": False, "moe_intermediate_size": 768,
                     "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": False,
                     "decoder_sparse_step": 1, "mlp_only_layers": []},
    config_aliases={"num_local_experts": "num_experts"},  # Qwen3MoeConfig.attribute_map
    extra_check=_check,
)
