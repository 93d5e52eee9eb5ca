"""Mistral: the Llama layout; refused when a sliding window can mask anything."""

from typing import Any

from models.families.base import LLAMA_DEFAULTS, Family, VllmArchitecture


def _check(config: Any) -> str | None:
    window = getattr(config, "sliding_window", None)
    # A window at least as long as the context never masks anything: that model is full attention.
    if window is not None and window < config.max_position_embeddings:
        return (
            f"sliding_window={window} < max_position_embeddings={config.max_position_embeddings} "
            "(sliding-window attention)"
        )
    return None


FAMILY = Family(
    name="mistral",
    model_types=("mistral",),
    hf_class="MistralForCausalLM",
    hf_config_class="MistralConfig",
    vllm=VllmArchitecture(dtp="DtpMistralForCausalLM", replaces="MistralForCausalLM"),
    # an omitted num_key_value_heads is 8 in MistralConfig (not "the attention heads")
    config_defaults={**LLAMA_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8,
                     "max_position_embeddings": 131072, "sliding_window": 4096},
    extra_check=_check,
)
