"""Which Hugging Face configurations a DTP layout is defined for, and the shape read from them."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoConfig

from models.families import UnsupportedModelError, family_for_config, model_shape, supported_model_types
from tests.tiny import BASE, FAMILY_CASES, tiny_config

SUPPORTED = ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe"]


def _refusal(config: Any) -> str:
    with pytest.raises(UnsupportedModelError) as info:
        family_for_config(config)
    msg = str(info.value)
    for model_type in SUPPORTED:  # every refusal lists what would have been accepted
        assert model_type in msg, msg
    return msg


def test_supported_model_types() -> None:
    assert supported_model_types() == SUPPORTED


@pytest.mark.parametrize("case", sorted(FAMILY_CASES))
def test_every_family_case_is_accepted(case: str) -> None:
    config = tiny_config(case)
    family = family_for_config(config)
    assert config.model_type in family.model_types
    assert family.qk_norm == (config.model_type == "qwen3")


@pytest.mark.parametrize(
    "config_factory, model_type",
    [
        (lambda: AutoConfig.for_model("gpt2"), "gpt2"),
        (lambda: AutoConfig.for_model("qwen2_moe"), "qwen2_moe"),  # shared experts: not a supported family
    ],
    ids=["gpt2", "qwen2_moe"],
)
def test_unknown_model_type_is_refused(config_factory: Any, model_type: str) -> None:
    msg = _refusal(config_factory())
    assert f"model_type={model_type!r}" in msg


def test_gelu_is_refused() -> None:
    msg = _refusal(tiny_config("llama", hidden_act="gelu"))
    assert "hidden_act='gelu'" in msg


@pytest.mark.parametrize("act", ["silu", "swish"])
def test_silu_spellings_are_accepted(act: str) -> None:
    family_for_config(tiny_config("llama", hidden_act=act))


def test_mlp_bias_is_refused() -> None:
    msg = _refusal(tiny_config("llama", mlp_bias=True))
    assert "mlp_bias=True" in msg


@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_attention_bias_is_refused(case: str) -> None:
    # Llama and Qwen3 put attention_bias on o_proj as well, which no device owns.
    msg = _refusal(tiny_config(case, attention_bias=True))
    assert "attention_bias=True" in msg


def test_qwen2_qkv_biases_are_accepted() -> None:
    family_for_config(tiny_config("qwen2"))  # q/k/v biases are column-parallel: fine


def test_mistral_sliding_window_is_refused() -> None:
    msg = _refusal(tiny_config("mistral", sliding_window=16))
    assert "sliding_window=16" in msg
    assert f"max_position_embeddings={BASE['max_position_embeddings']}" in msg


CONTEXT = BASE["max_position_embeddings"]


@pytest.mark.parametrize("window", [None, CONTEXT, 4 * CONTEXT], ids=["none", "equal", "longer"])
def test_mistral_window_that_masks_nothing_is_accepted(window: int | None) -> None:
    family_for_config(tiny_config("mistral", sliding_window=window))


@pytest.mark.parametrize("case", ["qwen2", "qwen3"])
def test_qwen_sliding_window_layers_are_refused(case: str) -> None:
    # Layers at index >= max_window_layers become sliding when use_sliding_window is set.
    config = tiny_config(case, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert "sliding_attention" in config.layer_types  # precondition: HF built a sliding model
    msg = _refusal(config)
    assert "sliding_attention" in msg
    assert "use_sliding_window=True" in msg


@pytest.mark.parametrize("case", ["qwen2", "qwen3"])
def test_qwen_explicit_sliding_layer_type_is_refused(case: str) -> None:
    config = tiny_config(case, layer_types=["full_attention", "sliding_attention", "full_attention"])
    msg = _refusal(config)
    assert "layer_types=" in msg and "sliding_attention" in msg


def test_several_reasons_are_all_named() -> None:
    msg = _refusal(tiny_config("llama", hidden_act="gelu", mlp_bias=True))
    assert "hidden_act='gelu'" in msg and "mlp_bias=True" in msg


@pytest.mark.parametrize(
    "case, head_dim",
    [
        ("llama", BASE["hidden_size"] // BASE["num_attention_heads"]),
        ("llama-tied-headdim", 8),
        ("mistral", BASE["hidden_size"] // BASE["num_attention_heads"]),
        ("qwen2", BASE["hidden_size"] // BASE["num_attention_heads"]),
        ("qwen3", 16),  # explicit head_dim != hidden_size / heads
    ],
)
def test_model_shape(case: str, head_dim: int) -> None:
    shape = model_shape(tiny_config(case))
    assert shape.model_type == FAMILY_CASES[case]["model_type"]
    assert shape.num_layers == BASE["num_hidden_layers"]
    assert shape.num_kv_groups == BASE["num_key_value_heads"]
    assert shape.num_query_heads == BASE["num_attention_heads"]
    assert shape.intermediate_size == BASE["intermediate_size"]
    assert shape.hidden_size == BASE["hidden_size"]
    assert shape.head_dim == head_dim
    assert shape.heads_per_group == 2


def test_model_shape_follows_overrides() -> None:
    shape = model_shape(tiny_config("qwen3", num_hidden_layers=5, num_key_value_heads=2, head_dim=32,
                                    intermediate_size=40))
    assert (shape.num_layers, shape.num_kv_groups, shape.heads_per_group, shape.head_dim,
            shape.intermediate_size) == (5, 2, 4, 32, 40)
