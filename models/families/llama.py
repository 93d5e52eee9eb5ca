"""Llama (SmolLM2, TinyLlama, Danube3): the reference module layout."""

from models.families.base import LLAMA_DEFAULTS, Family, VllmArchitecture, refuse_attention_bias

FAMILY = Family(
    name="llama",
    model_types=("llama",),
    hf_class="LlamaForCausalLM",
    hf_config_class="LlamaConfig",
    vllm=VllmArchitecture(dtp="DtpLlamaForCausalLM", replaces="LlamaForCausalLM"),
    config_defaults={**LLAMA_DEFAULTS, "attention_bias": False, "mlp_bias": False},
    extra_check=refuse_attention_bias,
)
