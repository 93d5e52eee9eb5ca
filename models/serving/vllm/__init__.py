"""The vLLM plugin: DTP variants of the llama, mistral, qwen2 and qwen3 models that run the shards `export`
writes under the schedule recorded in their config (every schedule: tp, dtp:δ, dtp:δ@K, ladder, spd:B, pt:D).

vLLM starts its workers with spawn, so the architectures are registered in every process through the
`vllm.general_plugins` entry point of the dtp-layout distribution (pyproject.toml), which calls `register`.
The classes are registered by name (`module:Class`), so loading the plugin imports no vLLM model code.
Only vLLM imports its models (`.model`); `dtp-layout vllm-serve` reads the torch-free `.options` to check its flags.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """vLLM's general-plugin hook: register DtpLlamaForCausalLM and its siblings."""
    from vllm import ModelRegistry

    from models.serving.manifest import DTP_ARCHITECTURES  # here, not above: `vllm-serve` imports .options alone

    for architecture in DTP_ARCHITECTURES.values():
        if architecture not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(architecture, f"models.serving.vllm.model:{architecture}")
