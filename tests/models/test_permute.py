"""Permuting a model by a layout preserves its function and puts each device's units in its shard."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

from models.base.layout_format import LayoutError
from models.families import model_shape
from models.layouts.layout import Layout, contiguous, random
from models.sim.permute import permute_, unpermute_
from tests.tiny import FAMILY_CASES, fresh, tokens

CASES = sorted(FAMILY_CASES)


def _state(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_permutation_preserves_logits_and_unpermute_restores(case: str, devices: int) -> None:
    model = fresh(case)
    ids = tokens(2, 10)
    before_state = _state(model)
    with torch.no_grad():
        before = model(ids).logits
    layout = random(model_shape(model.config), devices, 1, seed=devices)
    assert permute_(model, layout) is model
    after_state = _state(model)
    # The permutation really moved something (else the parity below proves nothing).
    assert not torch.equal(after_state["model.layers.0.mlp.gate_proj.weight"],
                           before_state["model.layers.0.mlp.gate_proj.weight"])
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, atol=1e-4, rtol=0)
    unpermute_(model, layout)
    restored = model.state_dict()
    assert restored.keys() == before_state.keys()
    for name, value in before_state.items():
        assert torch.equal(restored[name], value), name


@pytest.mark.parametrize("case", CASES)
def test_contiguous_layout_is_identity(case: str) -> None:
    model = fresh(case)
    before = _state(model)
    permute_(model, contiguous(model_shape(model.config), 2))
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def _device_groups(layout: Layout, layer: int, device: int) -> list[int]:
    return [g for g in range(layout.shape.num_kv_groups) if layout.kv_group_device[layer][g] == device]


def _device_neurons(layout: Layout, layer: int, device: int) -> list[int]:
    return [k for k in range(layout.shape.intermediate_size) if layout.neuron_device[layer][k] == device]


def _rows(units: list[int], width: int) -> list[int]:
    """Rows (or columns) owned by each unit of `width` consecutive rows, in unit order."""
    return [u * width + r for u in units for r in range(width)]


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_shard_l_holds_the_units_assigned_to_device_l(case: str, devices: int) -> None:
    original = fresh(case)
    model = fresh(case)
    shape = model_shape(model.config)
    layout = random(shape, devices, 1, seed=100 + devices)
    permute_(model, layout)
    hd, hpg = shape.head_dim, shape.heads_per_group
    q_out, kv_out = shape.num_query_heads * hd // devices, shape.num_kv_groups * hd // devices
    i_out = shape.intermediate_size // devices
    for i in range(shape.num_layers):
        orig = dict(original.model.layers[i].named_parameters())
        perm = dict(model.model.layers[i].named_parameters())
        for dev in range(devices):
            groups = _device_groups(layout, i, dev)
            heads = [g * hpg + j for g in groups for j in range(hpg)]  # each group's query heads
            q_rows = _rows(heads, hd)
            kv_rows = _rows(groups, hd)
            neurons = _device_neurons(layout, i, dev)
            assert len(groups) == shape.num_kv_groups // devices and len(neurons) == i_out
            q_sl, kv_sl = slice(dev * q_out, (dev + 1) * q_out), slice(dev * kv_out, (dev + 1) * kv_out)
            n_sl = slice(dev * i_out, (dev + 1) * i_out)
            expected_rows = {"q_proj": (q_rows, q_sl), "k_proj": (kv_rows, kv_sl), "v_proj": (kv_rows, kv_sl)}
            for proj, (rows, sl) in expected_rows.items():
                w = f"self_attn.{proj}.weight"
                assert torch.equal(perm[w][sl], orig[w][rows]), (i, dev, w)
                b = f"self_attn.{proj}.bias"
                if b in orig:
                    assert torch.equal(perm[b][sl], orig[b][rows]), (i, dev, b)
            w = "self_attn.o_proj.weight"
            assert torch.equal(perm[w][:, q_sl], orig[w][:, q_rows]), (i, dev, w)
            for proj in ("gate_proj", "up_proj"):
                w = f"mlp.{proj}.weight"
                assert torch.equal(perm[w][n_sl], orig[w][neurons]), (i, dev, w)
            w = "mlp.down_proj.weight"
            assert torch.equal(perm[w][:, n_sl], orig[w][:, neurons]), (i, dev, w)
        # Everything that belongs to no unit is untouched (norms, q/k norm gains).
        for name in orig:
            if "norm" in name:
                assert torch.equal(perm[name], orig[name]), name
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert torch.equal(model.get_parameter(name), original.get_parameter(name))
    if case == "qwen2":
        assert "self_attn.q_proj.bias" in orig  # the bias branch above was exercised


def test_permute_refuses_layout_for_other_model() -> None:
    model = fresh("llama")
    layout = random(model_shape(fresh("qwen3").config), 2, 1, 0)
    before = _state(model)
    with pytest.raises(LayoutError, match=r"model\.model_type=qwen3, the model has llama"):
        permute_(model, layout)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_permute_twice_composes() -> None:
    """permute(a) then permute(b) equals permuting once by the composed orders (function kept)."""
    model = fresh("qwen3")
    ids = tokens(1, 8)
    with torch.no_grad():
        ref = model(ids).logits
    shape = model_shape(model.config)
    a, b = random(shape, 2, 1, 1), random(shape, 4, 1, 2)
    permute_(model, a)
    permute_(model, b)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref, atol=1e-4, rtol=0)
    unpermute_(model, b)
    unpermute_(model, a)
    original = fresh("qwen3").state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, original[name]), name
