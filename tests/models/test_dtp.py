"""The DTP simulator against the dense HF model and against a literal transcription of §2 (1)-(3)."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from models.base.layout_format import LayoutError
from models.families import UnsupportedModelError, model_shape
from models.layouts.layout import Layout, contiguous, random
from models.sim.dtp import DTPCache, DTPModel
from models.sim.permute import permute_, unpermute_
from tests.tiny import FAMILY_CASES, fresh, tiny_model, tokens

CASES = sorted(FAMILY_CASES)


def permuted(case: str, devices: int, seed: int = 0, delta: int = 1) -> tuple[PreTrainedModel, Layout]:
    """A copy of the tiny model permuted by a random layout; returns (model, layout)."""
    model = fresh(case)
    layout = random(model_shape(model.config), devices, delta, seed)
    permute_(model, layout)
    return model, layout


# ---- the reference: equations (1)-(3) written out per device, on the ORIGINAL model -----------------

def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def ref_rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def ref_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + ref_rotate_half(x) * sin  # x, cos, sin: [B, S, hd]


def ref_linear_rows(x: torch.Tensor, lin: torch.nn.Linear, rows: slice) -> torch.Tensor:
    """The output features `rows` of `lin` (weight rows and bias entries)."""
    out = x @ lin.weight[rows].T
    if lin.bias is not None:
        out = out + lin.bias[rows]
    return out


def ref_attention_partial(model: PreTrainedModel, layout: Layout, i: int, dev: int, x: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Device `dev`'s partial output of attention `i` from its stream x [B, S, D], unpermuted model."""
    cfg = model.config
    shape = model_shape(cfg)
    hd, n_heads, n_groups = shape.head_dim, shape.num_query_heads, shape.num_kv_groups
    per_group = n_heads // n_groups
    layer = model.model.layers[i]
    attn = layer.self_attn
    eps = cfg.rms_norm_eps
    xn = ref_rms_norm(x, layer.input_layernorm.weight, eps)
    _, s, _ = x.shape
    future = torch.ones(s, s, dtype=torch.bool).triu(1)  # key j > query p is masked
    out = torch.zeros_like(x)
    for h in range(n_heads):
        g = h // per_group  # HF layout: query head h reads KV head h // (H/G)
        if layout.kv_group_device[i][g] != dev:
            continue
        q = ref_linear_rows(xn, attn.q_proj, slice(h * hd, (h + 1) * hd))  # [B, S, hd]
        k = ref_linear_rows(xn, attn.k_proj, slice(g * hd, (g + 1) * hd))
        v = ref_linear_rows(xn, attn.v_proj, slice(g * hd, (g + 1) * hd))
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm of q and k before the rotation
            q = ref_rms_norm(q, attn.q_norm.weight, eps)
            k = ref_rms_norm(k, attn.k_norm.weight, eps)
        q, k = ref_rope(q, cos, sin), ref_rope(k, cos, sin)
        scores = (q @ k.transpose(-1, -2)) * hd**-0.5  # [B, S, S]
        scores = scores.masked_fill(future, float("-inf"))
        weights = scores.exp() / scores.exp().sum(-1, keepdim=True)
        head_out = weights @ v  # [B, S, hd]
        out = out + head_out @ attn.o_proj.weight[:, h * hd:(h + 1) * hd].T
    return out


def ref_ffn_partial(model: PreTrainedModel, layout: Layout, i: int, dev: int,
                    x: torch.Tensor) -> torch.Tensor:
    layer = model.model.layers[i]
    mlp = layer.mlp
    neurons = [k for k in range(layout.shape.intermediate_size) if layout.neuron_device[i][k] == dev]
    xn = ref_rms_norm(x, layer.post_attention_layernorm.weight, model.config.rms_norm_eps)
    gate = xn @ mlp.gate_proj.weight[neurons].T  # [B, S, I/L]
    up = xn @ mlp.up_proj.weight[neurons].T
    act = gate * torch.sigmoid(gate) * up  # silu(gate) * up
    return act @ mlp.down_proj.weight[:, neurons].T


def ref_dtp_logits(model: PreTrainedModel, layout: Layout, ids: torch.Tensor, delta: int,
                   last_scale: str = "sqrt") -> torch.Tensor:
    """Equations (1)-(3): one residual stream per device, a loop over modules and devices."""
    L = layout.devices
    n_layers = model.config.num_hidden_layers
    n_modules = 2 * n_layers
    emb = model.model.embed_tokens(ids)  # [B, S, D]
    position_ids = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    cos, sin = model.model.rotary_emb(emb, position_ids)  # [B, S, hd]
    X = [emb.clone() for _ in range(L)]
    o: list[list[torch.Tensor]] = []  # o[n][l]: device l's partial of module n
    for n in range(n_modules):
        i = n // 2
        if n % 2 == 0:
            o.append([ref_attention_partial(model, layout, i, l, X[l], cos, sin) for l in range(L)])
        else:
            o.append([ref_ffn_partial(model, layout, i, l, X[l]) for l in range(L)])
        for l in range(L):
            if n < delta:  # (1)
                X[l] = X[l] + math.sqrt(L) * o[n][l]
                continue
            others = sum((o[n - delta][j] for j in range(L) if j != l), torch.zeros_like(X[l]))
            if n < n_modules - delta:  # (2)
                X[l] = X[l] + o[n][l] + others
            else:  # (3)
                own = math.sqrt(L) if last_scale == "sqrt" else 1.0
                X[l] = X[l] + own * o[n][l] + others
    final = sum(ref_rms_norm(X[l], model.model.norm.weight, model.config.rms_norm_eps) for l in range(L)) / L
    return final @ model.lm_head.weight.T


# ---- a. dense limits --------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_reference_is_dense_at_delta_zero(case: str) -> None:
    """Sanity of the reference itself: with δ=0 every device sees the full sum, i.e. the dense model."""
    model = fresh(case)
    ids = tokens(2, 9)
    layout = random(model_shape(model.config), 2, 0, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(ref_dtp_logits(model, layout, ids, 0), model(ids).logits,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_one_device_is_dense_for_any_delta(case: str) -> None:
    model = fresh(case)
    ids = tokens(2, 11)
    with torch.no_grad():
        dense = model(ids).logits
        for delta in range(model.config.num_hidden_layers + 1):
            for last_scale in ("sqrt", "one"):
                dtp = DTPModel(model, devices=1, delta=delta, last_scale=last_scale)
                torch.testing.assert_close(dtp(ids), dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_delta_zero_is_dense(case: str, devices: int) -> None:
    model, _ = permuted(case, devices, seed=devices)
    ids = tokens(2, 11)
    with torch.no_grad():
        dense = model(ids).logits
        got = DTPModel(model, devices=devices, delta=0)(ids)
        torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)
        # And DTP at δ=1 really is a different function (else the tests below would be vacuous).
        assert (DTPModel(model, devices=devices, delta=1)(ids) - dense).abs().max() > 1e-2


# ---- b. partials sum to the dense module outputs -----------------------------------------------

def _capture(model: PreTrainedModel, layer_idx: int, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Run the real HF forward and record layer `layer_idx`'s residual inputs and module outputs."""
    layer = model.model.layers[layer_idx]
    seen: dict[str, torch.Tensor] = {}

    def pre(name: str) -> Any:
        def hook(_mod: Any, args: tuple[Any, ...]) -> None:
            seen[name] = args[0].detach().clone()
        return hook

    def post(name: str) -> Any:
        def hook(_mod: Any, _args: Any, out: Any) -> None:
            seen[name] = (out[0] if isinstance(out, tuple) else out).detach().clone()
        return hook

    handles = [
        layer.input_layernorm.register_forward_pre_hook(pre("attn_in")),
        layer.self_attn.register_forward_hook(post("attn_out")),
        layer.post_attention_layernorm.register_forward_pre_hook(pre("ffn_in")),
        layer.mlp.register_forward_hook(post("ffn_out")),
    ]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_partials_sum_to_dense_module_outputs(case: str, devices: int) -> None:
    original = fresh(case)
    model, layout = permuted(case, devices, seed=7)
    dtp = DTPModel(model, devices=devices, delta=1)
    ids = tokens(2, 10)
    B, S = ids.shape
    position_ids = torch.arange(S)[None].expand(B, S)
    for layer_idx in range(model.config.num_hidden_layers):
        seen = _capture(model, layer_idx, ids)
        with torch.no_grad():
            h = seen["attn_in"]
            cos, sin = model.model.rotary_emb(h, position_ids)
            attn = dtp.attention_partials(layer_idx, h.expand(devices, *h.shape), cos, sin)
            assert attn.shape == (devices, B, S, h.shape[-1])
            torch.testing.assert_close(attn.sum(0), seen["attn_out"], atol=1e-5, rtol=1e-5)
            r = seen["ffn_in"]
            ffn = dtp.ffn_partials(layer_idx, r.expand(devices, *r.shape))
            torch.testing.assert_close(ffn.sum(0), seen["ffn_out"], atol=1e-5, rtol=1e-5)
            # Each device's own partial is that of the units the layout gives it (original model).
            for dev in range(devices):
                torch.testing.assert_close(
                    attn[dev], ref_attention_partial(original, layout, layer_idx, dev, h, cos, sin),
                    atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(ffn[dev], ref_ffn_partial(original, layout, layer_idx, dev, r),
                                           atol=1e-5, rtol=1e-5)


def test_partials_use_each_devices_own_stream() -> None:
    """Device l's partial depends on X_l only: changing X_0 changes partial 0 and nothing else."""
    model, _ = permuted("qwen3", 4, seed=2)
    dtp = DTPModel(model, devices=4, delta=1)
    x = torch.randn(4, 2, 6, model.config.hidden_size)
    cos, sin = model.model.rotary_emb(x[0], torch.arange(6)[None].expand(2, 6))
    y = x.clone()
    y[0] += torch.randn_like(y[0])
    with torch.no_grad():
        for fn in (lambda z: dtp.attention_partials(1, z, cos, sin), lambda z: dtp.ffn_partials(1, z)):
            a, b = fn(x), fn(y)
            assert not torch.allclose(a[0], b[0])
            torch.testing.assert_close(a[1:], b[1:], atol=0, rtol=0)


# ---- c. THE KEY TEST: DTPModel against the literal per-device transcription -----------------------

@pytest.mark.parametrize("last_scale", ["sqrt", "one"])
@pytest.mark.parametrize("delta", [1, 2, 3])
@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3", "llama-tied-headdim"])
def test_dtp_matches_literal_equations(case: str, devices: int, delta: int, last_scale: str) -> None:
    original = fresh(case)
    model, layout = permuted(case, devices, seed=10 * devices + delta, delta=delta)
    ids = tokens(2, 10, seed=delta)
    with torch.no_grad():
        expected = ref_dtp_logits(original, layout, ids, delta, last_scale)
        got = DTPModel(model, devices=devices, delta=delta, last_scale=last_scale)(ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_literal_equations_depend_on_layout_delta_and_last_scale() -> None:
    """The key test is not vacuous: the layout, δ and last_scale each change the DTP function."""
    model = fresh("llama")
    shape = model_shape(model.config)
    ids = tokens(2, 10)
    with torch.no_grad():
        base = ref_dtp_logits(model, random(shape, 2, 1, 0), ids, 1)
        for other in (ref_dtp_logits(model, random(shape, 2, 1, 1), ids, 1),
                      ref_dtp_logits(model, random(shape, 2, 1, 0), ids, 2),
                      ref_dtp_logits(model, random(shape, 2, 1, 0), ids, 1, "one"),
                      ref_dtp_logits(model, contiguous(shape, 2), ids, 1)):
            assert (other - base).abs().max() > 1e-3


def test_hidden_states_feed_lm_head() -> None:
    model, _ = permuted("llama-tied-headdim", 2)
    dtp = DTPModel(model, devices=2, delta=1)
    ids = tokens(1, 7)
    with torch.no_grad():
        h = dtp.hidden_states(ids)
        assert h.shape == (1, 7, model.config.hidden_size)
        torch.testing.assert_close(dtp(ids), h @ model.model.embed_tokens.weight.T, atol=1e-5, rtol=1e-5)


# ---- d. cached decoding -------------------------------------------------------------------------

@pytest.mark.parametrize("case, devices, delta", [("qwen2", 2, 1), ("qwen3", 4, 1), ("llama", 4, 2),
                                                  ("mistral", 2, 3)])
def test_cached_decoding_matches_full_forward(case: str, devices: int, delta: int) -> None:
    model, _ = permuted(case, devices, seed=3, delta=delta)
    dtp = DTPModel(model, devices=devices, delta=delta)
    ids = tokens(2, 12, seed=5)
    with torch.no_grad():
        full = dtp(ids)
        cache = DTPCache()
        assert cache.length == 0
        steps = [ids[:, :5]] + [ids[:, p:p + 1] for p in range(5, 8)] + [ids[:, 8:11], ids[:, 11:12]]
        pieces = []
        for step in steps:
            pieces.append(dtp(step, cache=cache))
            assert cache.length == sum(p.shape[1] for p in pieces)
        assert len(cache.keys) == model.config.num_hidden_layers
        assert cache.keys[0].shape == (devices * 2, 4 // devices, 12, model_shape(model.config).head_dim)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


def test_cached_chunks_only() -> None:
    """Prefill then two multi-token chunks (the bottom-right-aligned causal mask) at L=2, δ=1."""
    model, _ = permuted("llama", 2, seed=4)
    dtp = DTPModel(model, devices=2, delta=1)
    ids = tokens(1, 10, seed=6)
    with torch.no_grad():
        full = dtp(ids)
        cache = DTPCache()
        out = torch.cat([dtp(ids[:, :4], cache), dtp(ids[:, 4:7], cache), dtp(ids[:, 7:], cache)], dim=1)
    torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)


# ---- e. autograd ----------------------------------------------------------------------------------

def _loss(dtp: DTPModel, ids: torch.Tensor) -> torch.Tensor:
    logits = dtp(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def test_backward_reaches_wrapped_parameters() -> None:
    model, _ = permuted("qwen3", 2, seed=8)
    dtp = DTPModel(model, devices=2, delta=1)
    ids = tokens(2, 10)
    _loss(dtp, ids).backward()
    for i, layer in enumerate(model.model.layers):
        for p in (layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.mlp.down_proj.weight,
                  layer.mlp.gate_proj.weight, layer.self_attn.q_norm.weight, layer.input_layernorm.weight):
            assert p.grad is not None and p.grad.abs().sum() > 0, i
            assert torch.isfinite(p.grad).all()
        # Both devices' shards get a gradient.
        for shard in layer.mlp.down_proj.weight.grad.chunk(2, dim=1):
            assert shard.abs().sum() > 0
    assert model.model.embed_tokens.weight.grad is not None
    # The wrapper owns exactly the wrapped model's parameters (an optimiser on it trains the model).
    assert {id(p) for p in dtp.parameters()} == {id(p) for p in model.parameters()}


def test_gradients_match_literal_equations() -> None:
    """Grads of the DTP loss on the permuted model, unpermuted, equal the reference's grads."""
    devices, delta = 2, 1
    original = fresh("qwen2")
    model, layout = permuted("qwen2", devices, seed=9)
    ids = tokens(2, 8)
    _loss(DTPModel(model, devices=devices, delta=delta), ids).backward()
    ref_logits = ref_dtp_logits(original, layout, ids[:, :-1], delta)
    F.cross_entropy(ref_logits.reshape(-1, ref_logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    grads = copy.deepcopy(model)  # deepcopy drops .grad: copy the grads in as the weights
    by_name = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in grads.named_parameters():
            p.data = by_name[name].grad.clone()
    unpermute_(grads, layout)
    ref = dict(original.named_parameters())
    for name, g in grads.named_parameters():
        torch.testing.assert_close(g, ref[name].grad, atol=1e-5, rtol=1e-4, msg=name)


def test_gradient_checkpointing_gives_same_loss_and_grads() -> None:
    ids = tokens(2, 10)
    results = []
    for ckpt in (False, True):
        model, _ = permuted("qwen3", 4, seed=12, delta=2)
        model.train()
        dtp = DTPModel(model, devices=4, delta=2, gradient_checkpointing=ckpt).train()
        loss = _loss(dtp, ids)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], msg=name)
    assert grads_a["model.layers.2.mlp.down_proj.weight"].abs().sum() > 0


# ---- f. errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("devices", [3, 8])
def test_devices_not_dividing_groups_is_refused(devices: int) -> None:
    with pytest.raises(LayoutError, match=f"L={devices} does not divide num_kv_groups=4") as info:
        DTPModel(fresh("llama"), devices=devices, delta=1)
    assert "valid L for this model: 1, 2, 4" in str(info.value)


def test_devices_not_dividing_ffn_is_refused() -> None:
    with pytest.raises(LayoutError, match="intermediate_size=90"):
        DTPModel(tiny_model("llama", intermediate_size=90), devices=4, delta=1)


@pytest.mark.parametrize("delta", [-1, 4])
def test_delta_out_of_range_is_refused(delta: int) -> None:
    with pytest.raises(LayoutError, match=r"delta must be an integer in \[0, num_layers=3\]"):
        DTPModel(fresh("llama"), devices=2, delta=delta)


def test_delta_equal_to_num_layers_is_allowed() -> None:
    DTPModel(fresh("llama"), devices=2, delta=3)


def test_bogus_last_scale_is_refused() -> None:
    with pytest.raises(ValueError, match="last_scale must be 'sqrt' or 'one', got 'bogus'"):
        DTPModel(fresh("llama"), devices=2, delta=1, last_scale="bogus")  # type: ignore[arg-type]


def test_unsupported_model_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="hidden_act='gelu'"):
        DTPModel(tiny_model("llama", hidden_act="gelu"), devices=2, delta=1)
