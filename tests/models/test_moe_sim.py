"""The DTP simulator on mixture-of-experts models (issue 46) against the HF model and against a literal,
slow, per-device, per-token transcription of the schedule equation with an MoE FFN.

Under DTP device l keeps its own stream X_l, so its router reads ITS normed stream: per token, the softmax
over the E experts of h_l W_rᵀ, the k largest kept (renormalised where the family does), and device l's
partial is Σ_{e chosen by l} w_{l,e} Σ_{j of e on l} silu(h_l·w^g_{e,j}) (h_l·w^u_{e,j}) w^d_{e,j}. The
reference below loops over devices, tokens, chosen experts and the layout's neurons on the UNPERMUTED model;
the simulator runs the permuted one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from models.families import model_shape
from models.layouts.layout import Layout, random
from models.sim.dtp import DTPModel
from models.sim.permute import permute_, unpermute_
from tests.models.test_dtp import ref_attention_partial, ref_rms_norm
from tests.models.test_schedules import Tables, literal_tables
from tests.tiny import MOE_CASES, tiny_model, tokens

CASES = sorted(MOE_CASES)
SCHEDULES = ["tp", "dtp:1", "dtp:2", "pt:2"]


def renormalises(model: PreTrainedModel) -> bool:
    """Mixtral always renormalises the top-k weights; Qwen3-MoE when its config says so."""
    return model.config.model_type == "mixtral" or bool(model.config.norm_topk_prob)


def ref_moe_partial(model: PreTrainedModel, layout: Layout, i: int, dev: int, x: torch.Tensor,
                    chosen: list | None = None) -> torch.Tensor:
    """Device `dev`'s partial of MoE FFN `i` from its own stream x [B, S, D], token by token (unpermuted model).
    chosen: where to record the experts the device's router picked for each token."""
    cfg = model.config
    layer = model.model.layers[i]
    experts = layer.mlp.experts
    num_experts, k, I_e = experts.gate_up_proj.shape[0], cfg.num_experts_per_tok, experts.down_proj.shape[2]
    h = ref_rms_norm(x, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)  # [B, S, D]
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for s in range(x.shape[1]):
            probs = torch.softmax(layer.mlp.gate.weight @ h[b, s], dim=0)  # [E]
            order = torch.sort(probs, descending=True).indices[:k].tolist()
            weights = [float(probs[e]) for e in order]
            if renormalises(model):
                weights = [w / sum(weights) for w in weights]
            if chosen is not None:
                chosen.append(frozenset(order))
            for e, w in zip(order, weights, strict=True):
                mine = [j for j in range(I_e) if layout.neuron_device[i][e * I_e + j] == dev]
                gate = experts.gate_up_proj[e, mine] @ h[b, s]  # [n]
                up = experts.gate_up_proj[e, [I_e + j for j in mine]] @ h[b, s]
                act = gate * torch.sigmoid(gate) * up
                out[b, s] = out[b, s] + w * (experts.down_proj[e][:, mine] @ act)
    assert num_experts == layout.shape.num_experts
    return out


def ref_moe_logits(model: PreTrainedModel, layout: Layout, ids: torch.Tensor, tables: Tables,
                   chosen: dict | None = None) -> torch.Tensor:
    """The schedule equation (test_schedules' reference) with the MoE partial: X_l rebuilt from the sum."""
    b, s, a = tables
    L, M = layout.devices, len(b)
    emb = model.model.embed_tokens(ids)
    position_ids = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    cos, sin = model.model.rotary_emb(emb, position_ids)
    o: list[list[torch.Tensor]] = []

    def stream(l: int, t: int) -> torch.Tensor:
        X = emb.clone()
        for n in range(len(o)):
            if b[n] <= t:
                X = X + s[n] * o[n][l]
            if a[n] is not None and a[n] <= t:
                X = X + sum(o[n][j] for j in range(L) if j != l)
        return X

    for t in range(M):
        i = t // 2
        if t % 2 == 0:
            o.append([ref_attention_partial(model, layout, i, l, stream(l, t), cos, sin) for l in range(L)])
        else:
            picks = {l: [] for l in range(L)}
            o.append([ref_moe_partial(model, layout, i, l, stream(l, t), picks[l]) for l in range(L)])
            if chosen is not None:
                chosen[i] = picks
    final = sum(ref_rms_norm(stream(l, M), model.model.norm.weight, model.config.rms_norm_eps) for l in range(L)) / L
    return final @ model.lm_head.weight.T


def setup(case: str, devices: int, seed: int = 3) -> tuple[PreTrainedModel, PreTrainedModel, Layout]:
    """(original, permuted copy, the random MoE layout between them)."""
    original = tiny_model(case)
    model = tiny_model(case)
    layout = random(model_shape(model.config), devices, 1, seed)
    permute_(model, layout)
    return original, model, layout


@pytest.mark.parametrize("case", CASES)
def test_tp_simulator_is_the_hf_model(case: str) -> None:
    original, model, _layout = setup(case, 2)
    ids = tokens(2, 9)
    with torch.no_grad():
        expected = original(ids).logits
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)  # permuting keeps the function
        for schedule in ("tp", "dtp:0"):
            torch.testing.assert_close(DTPModel(model, devices=2, schedule=schedule)(ids), expected,
                                       rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_simulator_is_the_literal_per_device_forward(case: str, schedule: str) -> None:
    original, model, layout = setup(case, 2)
    ids = tokens(2, 7)
    chosen: dict = {}
    with torch.no_grad():
        expected = ref_moe_logits(original, layout, ids, literal_tables(schedule, 6, 2), chosen)
        got = DTPModel(model, devices=2, schedule=schedule)(ids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    if schedule != "tp":  # the devices' own streams differ, and somewhere so do their routers' choices
        assert any(chosen[i][0] != chosen[i][1] for i in chosen), "no token routed differently: the test is vacuous"
        assert (got - original(ids).logits).abs().max() > 1e-2


def test_four_devices_and_a_cache() -> None:
    """L = 4 at dtp:1, and decoding with the per-device cache equals the full forward."""
    original, model, layout = setup("mixtral", 4, seed=5)
    ids = tokens(1, 6)
    with torch.no_grad():
        expected = ref_moe_logits(original, layout, ids, literal_tables("dtp:1", 6, 4))
        sim = DTPModel(model, devices=4, delta=1)
        torch.testing.assert_close(sim(ids), expected, rtol=1e-4, atol=1e-4)
        from models.sim.dtp import DTPCache

        cache = DTPCache()
        steps = [sim(ids[:, :4], cache)] + [sim(ids[:, p : p + 1], cache) for p in range(4, 6)]
        torch.testing.assert_close(torch.cat(steps, dim=1), expected, rtol=1e-4, atol=1e-4)


def test_permutation_round_trips_and_keeps_each_expert_whole() -> None:
    original, model, layout = setup("qwen3_moe", 2)
    permuted: dict[str, Any] = {n: p.clone() for n, p in model.named_parameters()}
    unpermute_(model, layout)
    for name, param in original.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name], param, rtol=0, atol=0)
    # device 0's slice of expert 3 holds exactly the neurons the layout puts there, in storage order
    I_e = layout.shape.expert_size
    mine = [j for j in range(I_e) if layout.neuron_device[1][3 * I_e + j] == 0]
    gate_up = permuted["model.layers.1.mlp.experts.gate_up_proj"]
    torch.testing.assert_close(gate_up[3, : I_e // 2], original.model.layers[1].mlp.experts.gate_up_proj[3, mine])
