"""The affinity pass on mixture-of-experts models (issue 46) against autograd on the model as transformers
builds it.

Neuron u = e·I_e + j of an MoE FFN writes w_e(t) α_u(t) w^d_u into token t's residual, w_e(t) its router's
gate weight for expert e (0 where t does not reach e). The first-order damage of removing head h's piece
p_h = γ ⊙ W_o^(h) a_h / r from the FFN input, with the norm's rms and the routing held, is the derivative of
w_e α_u along that direction; the pass's scores are

    up FO [g, u]   = Σ_{h∈g} mean_t (∂_h (w_e α_u))² ‖w^d_u‖²
    up ADD [g, u]  = Σ_{h∈g} mean_t w_e² ((p_h·w^g_u)² + (p_h·w^u_u)²)
    down [u, g]    = mean_t ‖∂_u qkv_g‖²   (layer i+1's q/k/v of group g along u's write, its rms held)

The reference below computes each derivative with torch.func.jvp of functions written from transformers'
parameters (the router by a sort of the softmax, not models.sim.moe), per head and per unit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import jvp, vmap

from models.affinity.edges import schedule_affinity_pass
from models.affinity.file import AffinityResult
from models.affinity.scoring import affinity_pass
from models.families import model_shape
from models.schedules.grammar import resolve_schedule
from models.streaming.layer_source import CheckpointReader, StreamedModel
from tests.tiny import MOE_CASES, tiny_model, tokens

CASES = sorted(MOE_CASES)


def double(model: Any) -> Any:
    """The model in float64, its experts run by transformers' eager loop (its grouped-mm kernel takes no fp64)."""
    model.set_experts_implementation("eager")
    return model.double()


def trace(model: Any, ids: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Per layer: the streams entering attention and the FFN, and the heads before o_proj, over tokens [T, ·]."""
    layers = model.model.layers
    seen: dict[str, list[Any]] = {k: [None] * len(layers) for k in ("x_attn", "x_ffn", "heads")}

    def keep(name: str, i: int) -> Any:
        def hook(_mod: Any, args: tuple[Any, ...]) -> None:
            seen[name][i] = args[0].detach().reshape(-1, args[0].shape[-1]).clone()
        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles += [layer.input_layernorm.register_forward_pre_hook(keep("x_attn", i)),
                    layer.post_attention_layernorm.register_forward_pre_hook(keep("x_ffn", i)),
                    layer.self_attn.o_proj.register_forward_pre_hook(keep("heads", i))]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return seen


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()  # [T, 1]


def gate_of_units(model: Any, i: int, x: torch.Tensor) -> torch.Tensor:
    """w_e(t) for every unit u = e·I_e + j: [T, E·I_e], 0 where token t does not reach expert e: transformers'
    own router module on its own norm of x (its routing, to the rounding: a near-tie in the top k must fall
    the same way in the pass and here)."""
    layer = model.model.layers[i]
    _logits, kept, chosen = layer.mlp.gate(layer.post_attention_layernorm(x))  # [T, k] each
    weights = torch.zeros(x.shape[0], layer.mlp.gate.weight.shape[0], dtype=x.dtype)
    weights = weights.scatter(1, chosen, kept.to(x.dtype))
    return weights.repeat_interleave(layer.mlp.experts.down_proj.shape[2], dim=1)


def weighted_acts(model: Any, i: int, x: torch.Tensor, r: torch.Tensor, w: torch.Tensor,
                  at: torch.Tensor) -> torch.Tensor:
    """w_e α_u of every unit from stream x [T, D] with rms r and gate weights w held, around the stream `at`
    the model ran on: [T, E·I_e]. The norm is transformers' own at `at` (its float32 statistics: a unit whose
    up pre-activation nearly cancels is sensitive to their rounding) plus γ ⊙ (x - at) / r, whose derivative
    is the norm's with r held."""
    layer = model.model.layers[i]
    experts = layer.mlp.experts
    I_e = experts.down_proj.shape[2]
    norm = layer.post_attention_layernorm
    h = norm(at) + norm.weight * (x - at) / r
    gate = torch.cat([h @ experts.gate_up_proj[e, :I_e].t() for e in range(experts.gate_up_proj.shape[0])], dim=1)
    up = torch.cat([h @ experts.gate_up_proj[e, I_e:].t() for e in range(experts.gate_up_proj.shape[0])], dim=1)
    return w * F.silu(gate) * up


def down_columns(model: Any, i: int) -> torch.Tensor:
    """w^d_u of every unit: [E·I_e, D]."""
    down = model.model.layers[i].mlp.experts.down_proj  # [E, D, I_e]
    return down.permute(0, 2, 1).reshape(-1, down.shape[1])


def group_preacts(model: Any, j: int, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """q/k/v of every KV group of attention j from stream x with rms r held: [T, G, c]."""
    layer, G = model.model.layers[j], model.config.num_key_value_heads
    h = layer.input_layernorm.weight * x / r
    attn = layer.self_attn
    return torch.cat([(h @ p.weight.t()).unflatten(-1, (G, -1)) for p in (attn.q_proj, attn.k_proj, attn.v_proj)], -1)


@pytest.mark.parametrize("case", CASES)
def test_moe_scores_are_the_gate_weighted_first_order_damage(case: str) -> None:
    model = double(tiny_model(case))
    ids = tokens(2, 7)
    seen = trace(model, ids)
    shape = model_shape(model.config)
    H, hd, G, T = shape.num_query_heads, shape.head_dim, shape.num_kv_groups, ids.numel()
    eps = model.config.rms_norm_eps
    result = affinity_pass(model, ids, batch_size=2)
    with torch.no_grad():
        for i in range(shape.num_layers):
            layer = model.model.layers[i]
            x = seen["x_ffn"][i]
            r, w = rms(x, eps), gate_of_units(model, i, x)
            assert (w == 0).any() and (w > 0).any()  # some tokens miss some experts, and reach others

            def acts(xx: torch.Tensor, i: int = i, r: torch.Tensor = r, w: torch.Tensor = w,
                     at: torch.Tensor = x) -> torch.Tensor:
                return weighted_acts(model, i, xx, r, w, at)

            a = seen["heads"][i].view(T, H, hd)
            w_o = layer.self_attn.o_proj.weight.view(-1, H, hd)  # [D, H, hd]
            experts = layer.mlp.experts
            I_e = shape.expert_size
            w_g = torch.cat([experts.gate_up_proj[e, :I_e] for e in range(shape.num_experts)])  # [U, D]
            w_u = torch.cat([experts.gate_up_proj[e, I_e:] for e in range(shape.num_experts)])
            d = torch.einsum("thc,dhc->htd", a, w_o)  # every head's write: [H, T, D]
            delta = vmap(lambda v, x=x, acts=acts: jvp(acts, (x,), (v,))[1])(d)  # [H, T, U]
            fo = delta.square().mean(1)
            p = layer.post_attention_layernorm.weight * d / r  # [H, T, D]
            add = (w.square() * ((p @ w_g.t()).square() + (p @ w_u.t()).square())).mean(1)
            fo = fo * down_columns(model, i).square().sum(1)
            per_group = H // G
            np.testing.assert_allclose(result.up_fo[i], fo.view(G, per_group, -1).sum(1).numpy(), rtol=1e-6,
                                       atol=1e-12)
            np.testing.assert_allclose(result.up_add[i], add.view(G, per_group, -1).sum(1).numpy(), rtol=1e-6,
                                       atol=1e-12)
            if i + 1 < shape.num_layers:
                x_next = seen["x_attn"][i + 1]
                r_next = rms(x_next, eps)
                writes = acts(x)  # w_e α_u: [T, U]
                unit_writes = writes.t()[:, :, None] * down_columns(model, i)[:, None, :]  # [U, T, D]

                def qkv(xx: torch.Tensor, j: int = i + 1, rr: torch.Tensor = r_next) -> torch.Tensor:
                    return group_preacts(model, j, xx, rr)

                dq = vmap(lambda v, x=x_next, f=qkv: jvp(f, (x,), (v,))[1])(unit_writes)  # [U, T, G, c]
                down = dq.square().sum(-1).mean(1)
                np.testing.assert_allclose(result.down[i], down.numpy(), rtol=1e-6, atol=1e-12)


def expert_3_unreached() -> Any:
    """The fp64 tiny mixtral at top-1 with router rows v, -v and 0 for experts 0, 1 and 3: logits h·v, -h·v
    and 0, so max(h·v, -h·v) = |h·v| > 0 on every token and expert 3 is never chosen."""
    model = double(tiny_model("mixtral", num_experts_per_tok=1))
    with torch.no_grad():
        for layer in model.model.layers:
            router = layer.mlp.gate.weight  # [E, D]
            router[1] = -router[0]
            router[3] = 0.0
    return model


def test_an_expert_no_token_reaches_scores_zero() -> None:
    """Top-1 routing where expert 1 or 0 always wins over expert 3: router rows v, -v and 0 give logits h·v,
    -h·v and 0, so max(h·v, -h·v) = |h·v| > 0 on every token. Every edge of expert 3's neurons is exactly 0."""
    model = expert_3_unreached()
    result = affinity_pass(model, tokens(2, 7), batch_size=2)
    I_e = model_shape(model.config).expert_size
    for i in range(model.config.num_hidden_layers):
        assert (result.up_fo[i][:, 3 * I_e :] == 0).all() and (result.up_add[i][:, 3 * I_e :] == 0).all()
        assert (result.up_fo[i][:, : 3 * I_e] > 0).any()
        if i < len(result.down):
            assert (result.down[i][3 * I_e :] == 0).all()


@pytest.mark.parametrize("case", CASES)
def test_streamed_moe_affinity_equals_in_memory(tmp_path: Path, case: str) -> None:
    """Layer by layer from a checkpoint that holds the experts one at a time under the family's own names (as
    save_pretrained writes them), stacked into the fused parameters: the same scores as in memory."""
    model = tiny_model(case)
    model.save_pretrained(tmp_path, max_shard_size="40KB")  # several files and an index
    stored = CheckpointReader(tmp_path).names()
    assert not any("gate_up_proj" in n for n in stored) and any(".experts.3." in n for n in stored)
    blocks = tokens(3, 8)
    ours = affinity_pass(StreamedModel.open(tmp_path, dtype=torch.float32), blocks, batch_size=2)
    theirs = affinity_pass(model, blocks, batch_size=2)
    for name in ("up_fo", "up_add", "down"):
        for a, b in zip(getattr(ours, name), getattr(theirs, name), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)


def test_schedules_beyond_the_chain_score_their_further_edges_for_moe() -> None:
    """pt:2 on an MoE model: the chain's scores are `affinity_pass`'s, and every further edge the schedule needs is
    scored (against autograd in tests/models/test_moe_edges.py)."""
    model = tiny_model("mixtral")
    blocks = tokens(1, 6)
    schedule = resolve_schedule("pt:2", 3, 2)
    result = schedule_affinity_pass(model, blocks, schedule=schedule)
    chain = affinity_pass(model, blocks)
    assert result.schedule == "pt:2"
    assert sorted(result.edges) == sorted(AffinityResult.missing_edges_of(model_shape(model.config), schedule))
    for name in ("up_fo", "up_add", "down"):
        for a, b in zip(getattr(result, name), getattr(chain, name), strict=True):
            np.testing.assert_array_equal(a, b)
