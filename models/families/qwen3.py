"""Qwen3: the Llama layout with per-head RMSNorm on q and k (one gain shared by all heads)."""

from models.families.base import Family, VllmArchitecture, refuse_attention_bias
from models.families.qwen2 import QWEN_DEFAULTS

FAMILY = Family(
    name="qwen3",
    model_types=("qwen3",),
    hf_class="Qwen3ForCausalLM",
    hf_config_class="Qwen3Config",
    vllm=VllmArchitecture(dtp="DtpQwen3ForCausalLM", replaces="Qwen3ForCausalLM"),
    qk_norm=True,
    # head_dim is 128 whatever the width (Qwen3Config), not hidden / heads
    config_defaults={**QWEN_DEFAULTS, "head_dim": 128, "attention_bias": False},
    extra_check=refuse_attention_bias,
)
