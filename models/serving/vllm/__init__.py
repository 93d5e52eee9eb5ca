"""The vLLM plugin: a DTP variant of every registered family's model (`models.families.FAMILIES`, whose records
name each class and its module) that runs the shards `export` writes under the schedule recorded in their config
(every schedule: tp, dtp:δ, dtp:δ@K, ladder, spd:B, pt:D).

vLLM starts its workers with spawn, so the architectures are registered in every process through the
`vllm.general_plugins` entry point of the dtp-layout-vllm distribution, which calls `register`: a wheel of its
own that tools/vllm_wheel.py builds from this package and what it imports in models/, renamed (docs/serving.md).
The classes are registered by name (`module:Class`), so loading the plugin imports no vLLM model code.
Only vLLM imports its models (`.model`); `dtp-layout vllm-serve` reads the torch-free `.options` to check its flags.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """vLLM's general-plugin hook: register each family's DTP class (its record's `vllm`: name and module)."""
    from vllm import ModelRegistry

    from models.families import FAMILIES  # here, not above: `vllm-serve` imports .options alone

    for family in FAMILIES:
        if family.vllm is not None and family.vllm.dtp not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(family.vllm.dtp, family.vllm.class_path)
