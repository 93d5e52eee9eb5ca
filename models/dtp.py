"""The Delayed Tensor Parallelism forward (§2 of the paper) for L virtual devices on one machine.

Modules are numbered n = 0 .. 2N-1 (attention of layer i is 2i, its FFN 2i+1). Device l keeps its
own residual stream X_l and, after module n, adds its own partial o_n^l at once and the other
devices' partials of module n-δ:

    n < δ:              X_l += √L · o_n^l                                  (1)
    δ ≤ n < 2N-δ:       X_l += o_n^l + Σ_{j≠l} o_{n-δ}^j                   (2)
    n ≥ 2N-δ:           X_l += √L · o_n^l + Σ_{j≠l} o_{n-δ}^j              (3)

The final norm is applied per device and the L outputs are averaged. The model must already be
permuted (`models.permute.permute_`) so that device l's shard is the l-th contiguous slice; the
shards are views of the model's own parameters, so autograd trains the wrapped model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.families import family_for_config, model_shape
from models.layout import check_delta, check_devices
from models.permute import decoder_layers

LastScale = Literal["sqrt", "one"]


@dataclass
class DTPCache:
    """Per-device KV cache: keys/values per layer, [L*B, G/L, T, hd]."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Tokens seen so far (by the last layer, so that it is stable during a forward)."""
        return self.layer_length(len(self.keys) - 1) if self.keys else 0

    def layer_length(self, layer: int) -> int:
        return self.keys[layer].shape[2] if 0 <= layer < len(self.keys) else 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm exactly as the supported HF families compute it (fp32 statistics)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [L, B, heads, S, hd]; cos/sin: [B, S, hd] -> [1, B, 1, S, hd]
    cos, sin = cos[None, :, None], sin[None, :, None]
    return x * cos + _rotate_half(x) * sin


def _shard_linear(x: torch.Tensor, weight: torch.Tensor, devices: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """Column-parallel linear: device l applies rows l*O/L .. (l+1)*O/L of `weight`.

    x: [L, T, D]; weight: [O, D] -> [L, T, O/L]
    """
    w = weight.view(devices, -1, weight.shape[1])  # [L, O/L, D]
    if bias is None:
        return torch.bmm(x, w.transpose(1, 2))
    return torch.baddbmm(bias.view(devices, 1, -1), x, w.transpose(1, 2))


def _shard_linear_cols(x: torch.Tensor, weight: torch.Tensor, devices: int) -> torch.Tensor:
    """Row-parallel linear: device l applies columns l*C/L .. (l+1)*C/L of `weight`.

    x: [L, T, C/L]; weight: [D, C] -> partials [L, T, D]
    """
    w = weight.view(weight.shape[0], devices, -1).permute(1, 2, 0)  # [L, C/L, D]
    return torch.bmm(x, w)


class DTPModel(nn.Module):
    """DTP simulator over a (permuted) Hugging Face causal LM of a supported family."""

    model: Any  # a transformers causal LM (duck-typed: model.model.layers, lm_head, config)

    def __init__(self, model: Any, *, devices: int, delta: int, last_scale: LastScale = "sqrt",
                 gradient_checkpointing: bool = False) -> None:
        super().__init__()
        config = model.config
        self.family = family_for_config(config)
        self.shape = model_shape(config)
        check_devices(self.shape, devices)
        check_delta(self.shape, delta)
        if last_scale not in ("sqrt", "one"):
            raise ValueError(f"last_scale must be 'sqrt' or 'one', got {last_scale!r}")
        self.model = model
        self.devices = devices
        self.delta = delta
        self.last_scale = last_scale
        self.gradient_checkpointing = gradient_checkpointing
        self.eps = float(config.rms_norm_eps)
        self.num_modules = 2 * self.shape.num_layers
        self.scaling = self.shape.head_dim ** -0.5

    # ---- module partials ------------------------------------------------------------------
    def attention_partials(self, layer_idx: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           cache: DTPCache | None = None) -> torch.Tensor:
        """Each device's partial output of attention `layer_idx` from its own stream.

        x: [L, B, S, D] residual streams -> [L, B, S, D] partials (they sum to the dense output
        when all streams are equal).
        """
        L, B, S, D = x.shape
        heads_out = self.attention_heads(layer_idx, x, cos, sin, cache)  # [L, B*S, heads*hd]
        o_proj: Any = decoder_layers(self.model)[layer_idx].self_attn.o_proj  # type: ignore[union-attr]
        return _shard_linear_cols(heads_out, o_proj.weight, L).view(L, B, S, D)

    def attention_heads(self, layer_idx: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        cache: DTPCache | None = None) -> torch.Tensor:
        """Each device's heads' attention outputs, before o_proj.

        x: [L, B, S, D] -> [L, B*S, (H/L)*hd], head-major within a device.
        """
        L, B, S, D = x.shape
        hd = self.shape.head_dim
        heads, groups = self.shape.num_query_heads // L, self.shape.num_kv_groups // L
        layer: Any = decoder_layers(self.model)[layer_idx]
        attn = layer.self_attn
        h = rms_norm(x, layer.input_layernorm.weight, self.eps)
        h = h.reshape(L, B * S, D)
        q = _shard_linear(h, attn.q_proj.weight, L, attn.q_proj.bias)  # [L, B*S, heads*hd]
        k = _shard_linear(h, attn.k_proj.weight, L, attn.k_proj.bias)  # [L, B*S, groups*hd]
        v = _shard_linear(h, attn.v_proj.weight, L, attn.v_proj.bias)
        q = q.view(L, B, S, heads, hd).transpose(2, 3)  # [L, B, heads, S, hd]
        k = k.view(L, B, S, groups, hd).transpose(2, 3)  # [L, B, groups, S, hd]
        v = v.view(L, B, S, groups, hd).transpose(2, 3)
        if self.family.qk_norm:
            q = rms_norm(q, attn.q_norm.weight, self.eps)
            k = rms_norm(k, attn.k_norm.weight, self.eps)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        q = q.reshape(L * B, heads, S, hd)
        k = k.reshape(L * B, groups, S, hd)
        v = v.reshape(L * B, groups, S, hd)
        past = 0
        if cache is not None:
            past = cache.layer_length(layer_idx)
            k, v = cache.update(layer_idx, k, v)  # [L*B, groups, past+S, hd]
        out = self._sdpa(q, k, v, past)  # [L*B, heads, S, hd]
        return out.view(L, B, heads, S, hd).transpose(2, 3).reshape(L, B * S, heads * hd)

    def rotary(self, input_ids: torch.Tensor, emb: torch.Tensor, past: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions past .. past+S: [B, S, hd] each."""
        B, S = input_ids.shape
        position_ids = torch.arange(past, past + S, device=input_ids.device).unsqueeze(0).expand(B, S)
        cos, sin = self.model.model.rotary_emb(emb, position_ids)
        return cos, sin

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
        s, t = q.shape[2], k.shape[2]
        gqa = q.shape[1] != k.shape[1]
        if past == 0 or s == 1:
            # With a cache and one new token every key is visible; otherwise plain causal.
            return F.scaled_dot_product_attention(q, k, v, is_causal=past == 0 and s > 1,
                                                  scale=self.scaling, enable_gqa=gqa)
        # Chunked prefill on top of a cache: query p sees keys 0 .. past+p (bottom-right aligned).
        mask = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(diagonal=t - s)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=gqa)

    def ffn_partials(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        """x: [L, B, S, D] -> [L, B, S, D]: device l's neurons applied to device l's stream."""
        L, B, S, D = x.shape
        layer: Any = decoder_layers(self.model)[layer_idx]
        mlp = layer.mlp
        h = rms_norm(x, layer.post_attention_layernorm.weight, self.eps).reshape(L, B * S, D)
        gate = _shard_linear(h, mlp.gate_proj.weight, L)  # [L, B*S, I/L]
        up = _shard_linear(h, mlp.up_proj.weight, L)
        act = F.silu(gate) * up
        return _shard_linear_cols(act, mlp.down_proj.weight, L).view(L, B, S, D)

    # ---- the DTP recurrence -----------------------------------------------------------------
    def own_scale(self, n: int) -> float:
        """√L on the first δ modules and (unless last_scale='one') on the last δ, else 1."""
        root = math.sqrt(self.devices)
        if n < self.delta:
            return root
        if n >= self.num_modules - self.delta and self.last_scale == "sqrt":
            return root
        return 1.0

    def _module(self, n: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: DTPCache | None) -> torch.Tensor:
        layer_idx = n // 2
        if n % 2 == 0:
            if self.gradient_checkpointing and self.training and cache is None:
                out: torch.Tensor = checkpoint(self.attention_partials, layer_idx, x, cos, sin,
                                               use_reentrant=False)
                return out
            return self.attention_partials(layer_idx, x, cos, sin, cache)
        if self.gradient_checkpointing and self.training:
            out = checkpoint(self.ffn_partials, layer_idx, x, use_reentrant=False)
            return out
        return self.ffn_partials(layer_idx, x)

    def hidden_states(self, input_ids: torch.Tensor, cache: DTPCache | None = None) -> torch.Tensor:
        """input_ids: [B, S] -> final hidden state, normed per device then averaged: [B, S, D]."""
        inner = self.model.model
        emb = inner.embed_tokens(input_ids)  # [B, S, D]
        cos, sin = self.rotary(input_ids, emb, cache.length if cache is not None else 0)  # [B, S, hd]
        x = emb.unsqueeze(0).expand(self.devices, *emb.shape)  # [L, B, S, D]
        pending: list[torch.Tensor] = []  # partials of modules n-δ .. n, [L, B, S, D] each
        for n in range(self.num_modules):
            partial = self._module(n, x, cos, sin, cache)
            scale = self.own_scale(n)
            x = x + (partial * scale if scale != 1.0 else partial)
            pending.append(partial)
            if n >= self.delta:
                late = pending.pop(0)  # module n-δ, arriving now from the other devices
                x = x + (late.sum(0, keepdim=True) - late)
        h = rms_norm(x, inner.norm.weight, self.eps)  # [L, B, S, D]
        return h.mean(0)

    def forward(self, input_ids: torch.Tensor, cache: DTPCache | None = None) -> torch.Tensor:
        """input_ids: [B, S] -> logits [B, S, V] (lm_head is linear, so averaging before it is exact)."""
        logits: torch.Tensor = self.model.lm_head(self.hidden_states(input_ids, cache))
        return logits

