"""Hand-made per-expert balanced layouts (issue 46) for the tiny MoE models of tests/tiny.py (MOE_CASES), for the
export, runtime and serving tests of the MoE families."""

from __future__ import annotations

from typing import Any

import numpy as np

from models.families import family_for_config, model_shape
from models.layouts.layout import Layout
from tests.tiny import MOE_CASES, tiny_config, tiny_model

__all__ = ["MOE_CASES", "balanced_moe_layout", "expert_shape", "moe_model", "wide_moe_config"]


def moe_model(case: str, seed: int = 0) -> Any:
    """The case's tiny fp32 MoE model (a fresh one: the tests permute and export it)."""
    return tiny_model(case, seed=seed)


def wide_moe_config() -> Any:
    """A config only (its weights are never built): Qwen3-30B-A3B's FFN width, 128 experts × 768 neurons (I = 98,304
    units), on the tiny qwen3_moe's residual and attention: 57 M parameters whose dtp:2 edge pass would hold
    ~360 GiB (issue 46's refusal before any weight is read)."""
    return tiny_config("qwen3_moe", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)


def expert_shape(config: Any) -> tuple[int, int]:
    """(E, I_e) of an MoE config, from its family's record."""
    moe = family_for_config(config).moe
    assert moe is not None
    return moe.num_experts(config), moe.expert_size(config)


def balanced_moe_layout(model: Any, devices: int, delta: int = 1, seed: int = 0, name: str = "moe-test") -> Layout:
    """A random layout that puts I_e/L neurons of every expert and G/L KV groups on each device, written
    out from the convention of models.families.moe (unit e·I_e + j is expert e's neuron j)."""
    shape = model_shape(model.config)
    experts, size = expert_shape(model.config)
    rng = np.random.default_rng(seed)
    groups = [rng.permutation(np.repeat(np.arange(devices), shape.num_kv_groups // devices))
              for _ in range(shape.num_layers)]
    neurons = [np.concatenate([rng.permutation(np.repeat(np.arange(devices), size // devices))
                               for _ in range(experts)]) for _ in range(shape.num_layers)]
    return Layout(name, devices, delta, shape, np.stack(groups), np.stack(neurons))
