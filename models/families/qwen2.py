"""Qwen2 / Qwen2.5: the Llama layout with biases on q/k/v (their rows move with the group)."""

from models.families.base import LLAMA_DEFAULTS, Family, VllmArchitecture

# The Qwen configs' own defaults (Qwen2Config; Qwen3Config starts from them): an omitted
# num_key_value_heads is 32.
QWEN_DEFAULTS = {**LLAMA_DEFAULTS, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
                 "max_position_embeddings": 32768, "use_sliding_window": False}

FAMILY = Family(
    name="qwen2",
    model_types=("qwen2",),
    hf_class="Qwen2ForCausalLM",
    hf_config_class="Qwen2Config",
    vllm=VllmArchitecture(dtp="DtpQwen2ForCausalLM", replaces="Qwen2ForCausalLM"),
    qkv_bias=True,
    config_defaults=QWEN_DEFAULTS,
)
