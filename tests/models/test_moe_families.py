"""The mixture-of-experts families (qwen3_moe, mixtral: issue 46), their shape and refusals, and the MoE
layout: units are the experts' neurons expert-major (u = e·I_e + j), every expert balanced over the devices
on its own, each expert's neurons stably sorted by device within the expert."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from models.base.layout_format import LayoutError
from models.families import UnsupportedModelError, family_for_config, model_shape
from models.layouts.layout import check_fits, contiguous, from_json_dict, random
from tests.tiny import MOE_CASES, tiny_config

CASES = sorted(MOE_CASES)


@pytest.mark.parametrize("case", CASES)
def test_the_moe_cases_are_accepted_with_their_shape(case: str) -> None:
    config = tiny_config(case)
    family = family_for_config(config)
    assert family.moe is not None and family.name == case
    shape = model_shape(config)
    experts = MOE_CASES[case].get("num_experts") or MOE_CASES[case]["num_local_experts"]
    expert_size = MOE_CASES[case].get("moe_intermediate_size") or MOE_CASES[case]["intermediate_size"]
    assert (shape.num_experts, shape.expert_size, shape.experts_per_token) == (experts, expert_size, 2)
    assert shape.intermediate_size == experts * expert_size  # the layout's units per layer
    assert (shape.neuron_blocks, shape.block_size) == (experts, expert_size)


def test_a_dense_shape_has_no_experts() -> None:
    shape = model_shape(tiny_config("llama"))
    assert (shape.num_experts, shape.neuron_blocks, shape.block_size) == (0, 1, shape.intermediate_size)


def test_the_router_normalisation_is_the_families() -> None:
    qwen, mixtral = tiny_config("qwen3_moe"), tiny_config("mixtral")
    moe_q, moe_m = family_for_config(qwen).moe, family_for_config(mixtral).moe
    assert moe_q is not None and moe_m is not None
    assert moe_q.norm_topk_prob(qwen) is False and moe_q.norm_topk_prob(tiny_config("qwen3_moe", norm_topk_prob=True))
    assert moe_m.norm_topk_prob(mixtral) is True  # Mixtral always renormalises its top-k weights


@pytest.mark.parametrize(("case", "overrides", "named"), [
    ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers=[1] (dense FFN layers among the MoE ones"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9 (must be in [1, num_experts=8])"),
    ("qwen3_moe", {"attention_bias": True}, "attention_bias=True"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 (training noise on the router input"),
    ("mixtral", {"sliding_window": 16}, "sliding_window=16 < max_position_embeddings"),
])
def test_what_the_simulator_cannot_run_is_refused_by_name(case: str, overrides: dict, named: str) -> None:
    with pytest.raises(UnsupportedModelError) as info:
        family_for_config(tiny_config(case, **overrides))
    assert named in str(info.value)
    assert "qwen3_moe, mixtral" in str(info.value)  # and says what is accepted


# ---- the MoE layout -------------------------------------------------------------------------------------

def _per_expert_counts(neuron_device: np.ndarray, experts: int, devices: int) -> np.ndarray:
    """[N, E, L]: how many of each expert's neurons each device holds."""
    rows = neuron_device.reshape(neuron_device.shape[0], experts, -1)
    return np.apply_along_axis(lambda r: np.bincount(r, minlength=devices), 2, rows)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("devices", [2, 4])
def test_contiguous_and_random_layouts_balance_every_expert(case: str, devices: int) -> None:
    shape = model_shape(tiny_config(case))
    E, I_e = shape.num_experts, shape.expert_size
    for layout in (contiguous(shape, devices), random(shape, devices, seed=7)):
        assert layout.neuron_device.shape == (shape.num_layers, E * I_e)
        assert (_per_expert_counts(layout.neuron_device, E, devices) == I_e // devices).all()
    # contiguous: each expert's first I_e/L neurons on device 0, the next on device 1, … (vLLM's default MoE TP)
    row = contiguous(shape, devices).neuron_device[0]
    np.testing.assert_array_equal(row, np.tile(np.repeat(np.arange(devices), I_e // devices), E))
    # random layouts differ across experts and layers (not one shuffle repeated)
    rows = random(shape, devices, seed=7).neuron_device.reshape(shape.num_layers, E, I_e)
    assert len({tuple(r) for r in rows.reshape(-1, I_e)}) > 1


def test_the_neuron_order_sorts_each_expert_by_device_stably() -> None:
    shape = model_shape(tiny_config("mixtral"))
    layout = random(shape, 2, seed=3)
    I_e = shape.expert_size
    order = layout.neuron_order(1)
    for e in range(shape.num_experts):
        block = order[e * I_e : (e + 1) * I_e]
        devices = layout.neuron_device[1][block]
        # within expert e: its own neurons only, device 0's first, each device's in storage order
        assert sorted(block) == list(range(e * I_e, (e + 1) * I_e))
        np.testing.assert_array_equal(devices, np.repeat([0, 1], I_e // 2))
        for d in range(2):
            assert list(block[devices == d]) == sorted(block[devices == d])


def test_a_layout_balanced_only_overall_is_refused_naming_the_expert() -> None:
    shape = model_shape(tiny_config("mixtral"))
    good = contiguous(shape, 2)
    cells = good.neuron_device.copy()
    I_e = shape.expert_size
    cells[2, :I_e], cells[2, I_e : 2 * I_e] = 0, 1  # expert 0 all on device 0, expert 1 all on device 1
    data = good.to_json_dict() | {"neuron_device": cells.tolist()}
    with pytest.raises(LayoutError, match=r"neuron_device\[2\]: expert 0 unbalanced, per-device counts \[24, 0\], "
                                          r"expected 12 on each of 2 devices \(an MoE layout puts 12 of each"):
        from_json_dict(data)


def test_devices_must_divide_each_expert() -> None:
    shape = model_shape(tiny_config("mixtral", intermediate_size=6))  # 4 experts of 6: 24 units, but 6 % 4
    with pytest.raises(LayoutError, match=r"does not divide expert_size=6; L must divide both num_kv_groups and "
                                          r"expert_size: valid L for this model: 1, 2"):
        contiguous(shape, 4)


def test_the_layout_file_carries_the_experts_and_a_dense_one_is_unchanged() -> None:
    shape = model_shape(tiny_config("qwen3_moe"))
    layout = random(shape, 2, seed=1)
    data = json.loads(json.dumps(layout.to_json_dict()))
    assert data["model"] | {} == {**data["model"], "num_experts": 8, "experts_per_token": 2, "expert_size": 24}
    back = from_json_dict(data)
    assert back.shape == shape
    np.testing.assert_array_equal(back.neuron_device, layout.neuron_device)
    dense = contiguous(model_shape(tiny_config("llama")), 2).to_json_dict()["model"]
    assert not {"num_experts", "experts_per_token", "expert_size"} & set(dense)
    bad = data | {"model": {**data["model"], "intermediate_size": 100}}
    with pytest.raises(LayoutError, match=r"'model.intermediate_size' must be num_experts × expert_size = 8 × 24"):
        from_json_dict(bad)


def test_a_dense_layout_does_not_fit_an_moe_model_of_the_same_width() -> None:
    moe = model_shape(tiny_config("mixtral"))  # 4 × 24 = 96 units, the dense tiny width
    dense = model_shape(tiny_config("llama", hidden_size=64, head_dim=32))
    layout = contiguous(dense, 2)
    with pytest.raises(LayoutError, match=r"model\.model_type=llama"):
        check_fits(layout, moe)
    same_type = contiguous(moe, 2)
    with pytest.raises(LayoutError, match=r"model\.num_experts=4, the model has 0"):
        check_fits(same_type, replace(moe, num_experts=0))
