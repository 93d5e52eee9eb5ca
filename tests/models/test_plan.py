"""The sharding plan: what each family declares, and what is derived from it (split rules, per-device views)."""

from __future__ import annotations

import pytest
import torch

from models.export.files import checkpoint_state, split_rules
from models.families import LLAMA_PLAN, Colwise, PlanError, Rowwise, ShardingPlan, family_for_config, model_shape
from models.families.plan import local_shape, rank_slice, stacked_bias, stacked_weight
from tests.tiny import FAMILY_CASES, fresh, tiny_config

CASES = sorted(FAMILY_CASES)

# Written out by hand from the paper's §3 ("permuting the rows of the query, key and value projections
# (by group ...) and the columns of the output projection ..., and the rows of the gate and up projections
# and the columns of the down projection"): the rule every tensor of a Llama-layout checkpoint must get.
EXPECTED_RULE = {
    "self_attn.q_proj.weight": "rows", "self_attn.k_proj.weight": "rows", "self_attn.v_proj.weight": "rows",
    "self_attn.q_proj.bias": "rows", "self_attn.k_proj.bias": "rows", "self_attn.v_proj.bias": "rows",
    "self_attn.o_proj.weight": "cols",
    "mlp.gate_proj.weight": "rows", "mlp.up_proj.weight": "rows", "mlp.down_proj.weight": "cols",
}


@pytest.mark.parametrize("case", CASES)
def test_every_family_declares_a_plan_and_the_split_follows_it(case: str) -> None:
    model = fresh(case)
    family = family_for_config(model.config)
    assert family.plan is LLAMA_PLAN
    rules = split_rules(model)
    assert set(rules) == set(checkpoint_state(model))
    for name, rule in rules.items():
        within_layer = name.split(".", 3)[3] if name.startswith("model.layers.") else None
        assert rule == EXPECTED_RULE.get(within_layer, "replicated"), name  # type: ignore[arg-type]
    if case == "qwen2":
        assert rules["model.layers.0.self_attn.q_proj.bias"] == "rows"
    if case == "qwen3":
        assert rules["model.layers.0.self_attn.q_norm.weight"] == "replicated"


def test_a_row_parallel_bias_is_refused() -> None:
    with pytest.raises(PlanError, match=r"model\.layers\.2\.self_attn\.o_proj\.bias.*row-parallel"):
        LLAMA_PLAN.rule("model.layers.2.self_attn.o_proj.bias")


def test_a_malformed_plan_is_refused() -> None:
    with pytest.raises(PlanError, match=r"'mlp\.up_proj'"):
        ShardingPlan({"mlp.up_proj": Colwise("head")})  # type: ignore[arg-type]


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("case", ["qwen2", "llama-tied-headdim"])
def test_stacked_views_are_each_devices_slice(case: str, devices: int) -> None:
    """Device l's matrix (simulator, P = L) equals the l-th slice and equals the rank-l view (P = 1)."""
    model = fresh(case)
    layer = model.model.layers[1]
    for module, style in LLAMA_PLAN.modules.items():
        lin = layer.get_submodule(module)
        full = stacked_weight(lin.weight, style, devices)  # [L, in', out']
        rule = "rows" if isinstance(style, Colwise) else "cols"
        for dev in range(devices):
            piece = rank_slice(lin.weight, rule, dev, devices)
            assert tuple(piece.shape) == local_shape(tuple(lin.weight.shape), rule, devices)
            torch.testing.assert_close(full[dev], piece.T, rtol=0, atol=0)  # x @ W_l^T
            torch.testing.assert_close(stacked_weight(piece.contiguous(), style, 1)[0], piece.T, rtol=0, atol=0)
            if lin.bias is not None:
                assert isinstance(style, Colwise)
                torch.testing.assert_close(stacked_bias(lin.bias, devices)[dev, 0],
                                           lin.bias.chunk(devices)[dev], rtol=0, atol=0)
    assert isinstance(LLAMA_PLAN.style("self_attn.o_proj"), Rowwise)


def test_query_heads_follow_their_kv_group() -> None:
    """q_proj is split by KV group: device l's block of q rows is the query heads of its groups."""
    shape = model_shape(tiny_config("llama"))  # 8 query heads, 4 KV groups, head_dim 6
    q_rows = shape.num_query_heads * shape.head_dim
    per_group = q_rows // shape.num_kv_groups
    assert per_group == shape.heads_per_group * shape.head_dim
    index = torch.arange(q_rows)
    block = rank_slice(index, "rows", 1, 2)  # device 1 of 2: groups 2 and 3 -> heads 4..7
    assert block.tolist() == list(range(4 * shape.head_dim, 8 * shape.head_dim))
