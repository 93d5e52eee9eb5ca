"""The edges a schedule adds beyond the paper's chain, on mixture-of-experts models (issue 46), against autograd on
the model as transformers builds it.

Unit u = e·I_e + j of an MoE FFN writes w_e(t) α_u(t) w^d_u into token t's residual, w_e(t) its router's gate
weight of expert e (0 where t does not reach e). A sending unit's write d is a head's W_o^(h) a_h or an MoE
unit's w_e α_u w^d_u; the receiving unit's first-order damage of d missing from its input, with its norm's rms
and its router's choice and weights held, is the derivative along d of

    receiving KV group g:  its q/k/v pre-activations          S = mean_t ‖∂_d qkv_g‖²           (FO = ADD)
    receiving MoE unit u:  w_e α_u                            FO = mean_t (∂_d (w_e α_u))² ‖w^d_u‖²
                                                              ADD = mean_t w_e² ((p·w^g_u)² + (p·w^u_u)²)

(p = γ ⊙ d / r). The reference takes each derivative with torch.func.jvp of functions written from transformers'
parameters (`tests.models.test_moe_affinity`, whose chain scores are checked the same way), per sending unit; a
head's scores are summed over its KV group.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.func import jvp, vmap

from models.affinity.edge_memory import accumulator_bytes, dense_edge_bytes
from models.affinity.edges import _EdgeAccumulator, quadratic_trace, schedule_affinity_pass, sum_of_squares
from models.affinity.file import AffinityResult
from models.families import model_shape
from models.layouts import layout as layout_mod
from models.optimise.edges import edge_kind
from models.schedules.grammar import resolve_schedule
from models.variants.set import build_layouts
from tests.models.test_moe_affinity import (
    double,
    down_columns,
    expert_3_unreached,
    gate_of_units,
    group_preacts,
    rms,
    trace,
    weighted_acts,
)
from tests.tiny import MOE_CASES, tiny_model, tokens

CASES = sorted(MOE_CASES)


def sender_writes(model: Any, seen: dict, m: int) -> torch.Tensor:
    """Every sending unit's write into the residual stream of module m: [U, T, D] (heads, or w_e α_u w^d_u)."""
    shape = model_shape(model.config)
    i = m // 2
    if m % 2 == 0:
        H, hd = shape.num_query_heads, shape.head_dim
        a = seen["heads"][i].view(-1, H, hd)  # [T, H, hd]
        w_o = model.model.layers[i].self_attn.o_proj.weight.view(-1, H, hd)  # [D, H, hd]
        return torch.einsum("thc,dhc->htd", a, w_o)
    x = seen["x_ffn"][i]
    writes = weighted_acts(model, i, x, rms(x, model.config.rms_norm_eps), gate_of_units(model, i, x), x)  # [T, U]
    return writes.t()[:, :, None] * down_columns(model, i)[:, None, :]


def expected_scores(model: Any, seen: dict, m: int, t: int) -> dict[str, np.ndarray]:
    """FO and ADD of edge (m, t) from the derivatives of the docstring: [U_m, U_t]."""
    shape = model_shape(model.config)
    eps = model.config.rms_norm_eps
    d = sender_writes(model, seen, m)  # [U_m, T, D]
    j = t // 2
    if t % 2 == 0:
        x = seen["x_attn"][j]
        r = rms(x, eps)

        def qkv(xx: torch.Tensor) -> torch.Tensor:
            return group_preacts(model, j, xx, r)

        delta = vmap(lambda v: jvp(qkv, (x,), (v,))[1])(d)  # [U_m, T, G, c]
        fo = add = delta.square().sum(-1).mean(1)
    else:
        x = seen["x_ffn"][j]
        r, w = rms(x, eps), gate_of_units(model, j, x)  # w: [T, U_t], the routing held
        assert (w == 0).any() and (w > 0).any()  # some tokens are routed away from some experts: their terms are 0

        def acts(xx: torch.Tensor) -> torch.Tensor:
            return weighted_acts(model, j, xx, r, w, x)

        delta = vmap(lambda v: jvp(acts, (x,), (v,))[1])(d)  # [U_m, T, U_t]
        fo = delta.square().mean(1) * down_columns(model, j).square().sum(1)
        layer = model.model.layers[j]
        experts, I_e = layer.mlp.experts, shape.expert_size
        w_g = torch.cat([experts.gate_up_proj[e, :I_e] for e in range(shape.num_experts)])  # [U_t, D]
        w_u = torch.cat([experts.gate_up_proj[e, I_e:] for e in range(shape.num_experts)])
        p = layer.post_attention_layernorm.weight * d / r  # [U_m, T, D]
        add = (w.square() * ((p @ w_g.t()).square() + (p @ w_u.t()).square())).mean(1)
    if m % 2 == 0:  # a KV group's score is the sum of its query heads'
        fo = fo.view(shape.num_kv_groups, shape.heads_per_group, -1).sum(1)
        add = add.view(shape.num_kv_groups, shape.heads_per_group, -1).sum(1)
    return {"fo": fo.numpy(), "add": add.numpy()}


@pytest.mark.parametrize("case", CASES)
def test_moe_edges_beyond_the_chain_are_the_gate_weighted_first_order_damage(case: str) -> None:
    """pt:3 on the 3-layer model joins every pair of modules: each further edge, of all four kinds, equals the
    reference (the chain's edges are tests/models/test_moe_affinity.py's)."""
    model = double(tiny_model(case))
    ids = tokens(2, 5)  # two micro-batches of 5 tokens (batch_size 1): the sums run over both
    seen = trace(model, ids)
    result = schedule_affinity_pass(model, ids, batch_size=1, schedule=resolve_schedule("pt:3", 3, 2))
    assert result.schedule == "pt:3" and len(result.edges) == 15 - 5
    assert {edge_kind(p) for p in result.edges} == {"up", "down", "kv-kv", "neuron-neuron"}
    for (m, t), scores in result.edges.items():
        with torch.no_grad():
            expected = expected_scores(model, seen, m, t)
        for name in ("fo", "add"):
            assert expected[name].max() > 0
            np.testing.assert_allclose(scores[name], expected[name], rtol=1e-6, atol=1e-12 * expected[name].max())


def test_an_expert_no_token_reaches_sends_and_receives_nothing() -> None:
    """Top-1 routing where expert 0 or 1 always wins over expert 3 (router rows v, -v and 0: max(h·v, -h·v) > 0
    on every token): every further edge out of and into expert 3's neurons is exactly 0, the others' are not."""
    model = expert_3_unreached()
    result = schedule_affinity_pass(model, tokens(1, 7), schedule=resolve_schedule("pt:3", 3, 2))
    I_e = model_shape(model.config).expert_size
    unreached = slice(3 * I_e, 4 * I_e)
    for (m, t), scores in result.edges.items():
        for matrix in scores.values():
            matrix = np.asarray(matrix)
            if m % 2:  # a sending FFN: expert 3's rows
                assert (matrix[unreached] == 0).all() and (matrix[: 3 * I_e] > 0).any()
            if t % 2:  # a receiving FFN: expert 3's columns
                assert (matrix[:, unreached] == 0).all() and (matrix[:, : 3 * I_e] > 0).any()


def test_head_to_later_ffn_edges_in_neuron_blocks_are_the_whole_fold(monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiving FFN's E·I_e units folded in blocks (50: uneven, the last one short) score as one block does."""
    from models.affinity import edges

    model = tiny_model("qwen3_moe")
    ids = tokens(1, 6)
    ups = [(0, 3), (0, 5), (2, 5)]  # head → a later layer's FFN
    assert {edge_kind(p) for p in ups} == {"up"}
    whole = edges.edge_pass(model, ids, ups)
    assert model_shape(model.config).intermediate_size % 50 and edges.NEURON_BLOCK > 192
    monkeypatch.setattr(edges, "NEURON_BLOCK", 50)
    blocked = edges.edge_pass(model, ids, ups)
    for p in ups:
        for name in ("fo", "add"):
            assert whole[p][name].max() > 0
            np.testing.assert_allclose(blocked[p][name], whole[p][name], rtol=1e-5, atol=0)


@pytest.mark.parametrize("case", CASES)
def test_moe_accumulators_are_what_the_memory_bound_counts(case: str) -> None:
    """`accumulator_bytes` (which splits the pass into rounds) is the accumulators' float64 sums, plus the dense
    finished scores of a neuron → neuron edge, for I = E·I_e units."""
    shape = model_shape(tiny_model(case).config)
    assert shape.intermediate_size == shape.num_experts * shape.expert_size
    for pair in ((0, 3), (1, 2 + 2), (0, 2), (1, 3)):  # up, down, kv-kv, neuron-neuron
        acc = _EdgeAccumulator(pair, shape, torch.device("cpu"))
        parts = [vars(acc), *([vars(acc.layer)] if hasattr(acc, "layer") else [])]
        sums = [v for part in parts for v in part.values() if isinstance(v, torch.Tensor)]
        held = sum(v.numel() * v.element_size() for v in sums)
        extra = dense_edge_bytes(pair, shape) if edge_kind(pair) == "neuron-neuron" else 0
        assert accumulator_bytes(pair, shape) == held + extra


@pytest.mark.parametrize(("case", "schedule", "delta"), [("qwen3_moe", "dtp:2", 2), ("mixtral", "pt:2", 1)])
def test_optimise_for_a_schedule_gives_per_expert_balanced_layouts(case: str, schedule: str, delta: int) -> None:
    """The pass's edges through the optimiser: every layout balanced per expert, the optimised J_σ at least the
    contiguous and random layouts' (each checked in both units against the schedule's objective)."""
    model = tiny_model(case)
    shape = model_shape(model.config)
    resolved = resolve_schedule(schedule, shape.num_layers, 2)
    result = schedule_affinity_pass(model, tokens(2, 16), batch_size=2, schedule=resolved)
    assert result.edges and set(result.edges) == set(AffinityResult.missing_edges_of(shape, resolved))
    layouts = build_layouts(result, devices=2, delta=delta, random_layouts=2, restarts=1, schedule=resolved)
    assert set(layouts) == {"optimised", "contiguous", "random-1000", "random-1001"}
    for lay in layouts.values():
        layout_mod.validate(lay)  # every expert's neurons balanced over the devices on its own
        assert lay.schedule == schedule and lay.shape.num_experts == shape.num_experts
    best = layouts["optimised"]
    assert not np.array_equal(best.neuron_device, layouts["contiguous"].neuron_device)
    for name, lay in layouts.items():
        if name != "optimised":
            assert best.score["J"] >= lay.score["J"] - 1e-12, name


def test_a_cancelling_neuron_to_neuron_form_is_zero_not_negative() -> None:
    # a receiving unit whose gate and up folds cancel the sender's write (mg·A = −mu·B on every token): the exact
    # damage Σ_t (mg·A_t + mu·B_t)² is 0, its expansion from the moments rounds below it (seen as −1.8e-14 on the
    # converted SmolLM2 at dtp:2, which ScheduleAffinity refused)
    g = torch.Generator().manual_seed(0)
    a = torch.rand(64, dtype=torch.float64, generator=g)
    b = 1.7 * a
    mg = torch.rand(50, dtype=torch.float64, generator=g)
    mu = -mg / 1.7
    expanded = mg.square() * (a * a).sum() + 2 * mg * mu * (a * b).sum() + mu.square() * (b * b).sum()
    assert (expanded < 0).any()  # the rounding this guards against
    form = sum_of_squares(mg, mu, (a * a).sum(), (a * b).sum(), (b * b).sum())
    direct = ((mg[:, None] * a + mu[:, None] * b) ** 2).sum(1)  # [50]: the sum of squares itself
    assert (form >= 0).all()
    torch.testing.assert_close(form, direct, atol=1e-12, rtol=0)
    mu = torch.rand(50, dtype=torch.float64, generator=g)  # nothing cancels: the form is the sum of squares
    torch.testing.assert_close(sum_of_squares(mg, mu, (a * a).sum(), (a * b).sum(), (b * b).sum()),
                               ((mg[:, None] * a + mu[:, None] * b) ** 2).sum(1), rtol=1e-12, atol=0)


def test_a_head_to_head_form_in_the_covariances_null_space_is_zero_not_negative() -> None:
    # a receiver whose folded rows F_h lie in the null space of the sender's covariance Σ_h (rank 5 of 8): the exact
    # tr(F Σ Fᵀ) is 0; the elementwise sum rounds to about ±1e-16 (negative here for head 1)
    g = torch.Generator().manual_seed(0)
    writes = torch.randn(3, 5, 8, dtype=torch.float64, generator=g)  # [H, T, hd]
    cov = writes.transpose(1, 2) @ writes  # [H, hd, hd]
    null = [torch.linalg.qr(w.t(), mode="complete")[0][:, 5:] for w in writes]  # [hd, 3] each
    fold = torch.stack([torch.randn(4, 3, dtype=torch.float64, generator=g) @ n.t() for n in null])  # [H, C, hd]
    expanded = (torch.bmm(fold, cov) * fold).sum((1, 2))
    assert (expanded < 0).any()  # the rounding this guards against
    assert (quadratic_trace(fold, cov) >= 0).all()
    torch.testing.assert_close(quadratic_trace(fold, cov), torch.zeros(3, dtype=torch.float64), atol=1e-14, rtol=0)
    fold = torch.randn(3, 4, 8, dtype=torch.float64, generator=g)  # in general: the trace itself
    direct = torch.stack([torch.trace(f @ c @ f.t()) for f, c in zip(fold, cov, strict=True)])
    torch.testing.assert_close(quadratic_trace(fold, cov), direct, rtol=1e-12, atol=0)
