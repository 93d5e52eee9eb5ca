"""bench/joint_damage.py against a per-token transcription of its equations on a tiny random llama: the
units' writes taken from the Hugging Face model's own o_proj / down_proj inputs, each device's stream
deviation summed unit by unit from the schedule's table, each receiving unit's damage token by token."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bench.joint_damage import joint_damage
from models.base.shapes import ModelShape
from models.layouts import layout as layout_mod
from models.schedules.grammar import resolve_schedule
from tests.tiny import tiny_model, tokens


def _dense_trace(model, ids):
    """Per layer: the residual entering attention and FFN, o_proj's and down_proj's inputs (one sequence)."""
    trace: dict[str, list[torch.Tensor]] = {"x_attn": [], "x_ffn": [], "heads": [], "act": []}
    hooks = []
    for layer in model.model.layers:
        hooks += [
            layer.input_layernorm.register_forward_pre_hook(lambda _m, a: trace["x_attn"].append(a[0][0])),
            layer.post_attention_layernorm.register_forward_pre_hook(lambda _m, a: trace["x_ffn"].append(a[0][0])),
            layer.self_attn.o_proj.register_forward_pre_hook(lambda _m, a: trace["heads"].append(a[0][0])),
            layer.mlp.down_proj.register_forward_pre_hook(lambda _m, a: trace["act"].append(a[0][0])),
        ]
    with torch.no_grad():
        model(ids[None])
    for h in hooks:
        h.remove()
    return trace


@torch.no_grad()
def _transcribed(model, blocks, schedule, heads, cells):
    cfg = model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    per_group = cfg.num_attention_heads // cfg.num_key_value_heads
    L, M = schedule.devices, schedule.num_modules
    ffn_total = attn_total = 0.0
    count = 0
    for ids in blocks:
        tr = _dense_trace(model, ids)
        layers = model.model.layers
        for pos in range(ids.shape[0]):
            # every unit's write at this token: module n → [(device, write [D])]
            writes: dict[int, list[tuple[int, torch.Tensor]]] = {}
            for i, layer in enumerate(layers):
                w_o = layer.self_attn.o_proj.weight.double()
                a = tr["heads"][i][pos].double()
                writes[2 * i] = [(int(heads[i, h // per_group]), w_o[:, h * hd:(h + 1) * hd] @ a[h * hd:(h + 1) * hd])
                                 for h in range(cfg.num_attention_heads)]
                w_d = layer.mlp.down_proj.weight.double()
                act = tr["act"][i][pos].double()
                writes[2 * i + 1] = [(int(cells[i, k]), act[k] * w_d[:, k]) for k in range(act.shape[0])]
            for t in range(M):
                layer = layers[t // 2]
                x = (tr["x_attn"] if t % 2 == 0 else tr["x_ffn"])[t // 2][pos].double()
                r = x.pow(2).mean().add(cfg.rms_norm_eps).sqrt()
                for d in range(L):
                    dev = torch.zeros_like(x)
                    for m in range(t):
                        b, a_, s = schedule.own_arrival[m], schedule.other_arrival[m], schedule.own_scale[m]
                        for unit_device, write in writes[m]:
                            own = unit_device == d
                            held = (s if own and b <= t else 0.0) + (1.0 if not own and a_ is not None and a_ <= t
                                                                    else 0.0)
                            dev += (held - 1.0) * write
                    if t % 2 == 0:
                        p = layer.input_layernorm.weight.double() * dev / r
                        attn = layer.self_attn
                        for g in np.flatnonzero(heads[t // 2] == d):
                            q = attn.q_proj.weight.double()[g * per_group * hd:(g + 1) * per_group * hd]
                            k = attn.k_proj.weight.double()[g * hd:(g + 1) * hd]
                            v = attn.v_proj.weight.double()[g * hd:(g + 1) * hd]
                            attn_total += float(sum((w @ p).square().sum() for w in (q, k, v)))
                    else:
                        gamma = layer.post_attention_layernorm.weight.double()
                        normed = gamma * x / r
                        mlp = layer.mlp
                        for k in np.flatnonzero(cells[t // 2] == d):
                            wg, wu = mlp.gate_proj.weight.double()[k], mlp.up_proj.weight.double()[k]
                            g_, u_ = normed @ wg, normed @ wu
                            sig = torch.sigmoid(g_)
                            p = gamma * dev / r
                            delta = sig * (1 + g_ * (1 - sig)) * u_ * (p @ wg) + F.silu(g_) * (p @ wu)
                            ffn_total += float(delta.square() * mlp.down_proj.weight.double()[:, k].square().sum())
            count += 1
    return ffn_total / count, attn_total / count


@pytest.mark.parametrize("name", ["dtp:2", "pt:2", "dtp:1", "spd:1"])
def test_joint_damage_matches_a_per_token_transcription(name):
    model = tiny_model("llama", num_hidden_layers=2)
    schedule = resolve_schedule(name, 2, 2)
    layout = layout_mod.random(ModelShape("llama", 2, 4, 8, 96, 48, 6), 2, seed=3)
    blocks = tokens(batch=2, seq=5)
    got = joint_damage(model, blocks, schedule, layout.kv_group_device, layout.neuron_device)
    ffn, attn = _transcribed(model, blocks, schedule, layout.kv_group_device, layout.neuron_device)
    assert got["tokens"] == 10
    assert got["ffn"] == pytest.approx(ffn, rel=1e-5) and ffn > 0
    assert got["attention"] == pytest.approx(attn, rel=1e-5, abs=1e-12)
    assert (attn > 0) == (name != "spd:1")  # spd delays an attention's others past its FFN only


def test_a_layout_independent_schedule_has_no_joint_damage_and_the_layout_moves_it_otherwise():
    model = tiny_model("llama", num_hidden_layers=2)
    shape = ModelShape("llama", 2, 4, 8, 96, 48, 6)
    blocks = tokens(batch=1, seq=8)
    lays = [layout_mod.contiguous(shape, 2), layout_mod.random(shape, 2, seed=1)]
    tp = [joint_damage(model, blocks, resolve_schedule("tp", 2, 2), x.kv_group_device, x.neuron_device)
          for x in lays]
    assert all(r["ffn"] == 0 and r["attention"] == 0 for r in tp)
    dtp = [joint_damage(model, blocks, resolve_schedule("dtp:1", 2, 2), x.kv_group_device, x.neuron_device)
           for x in lays]
    assert dtp[0]["ffn"] != pytest.approx(dtp[1]["ffn"], rel=1e-3)
