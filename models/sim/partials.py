"""Each device's partial output of a decoder module, computed on weights stacked over a device axis.

The same code serves the simulator and the runtime: the simulator stacks all L devices' slices of
the permuted model (`ModelWeights`, views of the model's own parameters, so autograd trains it) and
computes every device in one batched matmul; a runtime rank stacks its own slice alone (P = 1,
`models.runtime.shards.RankWeights`). How each linear's weight becomes P per-device matrices is
the family's sharding plan (`models.families.plan.stacked_weight`).

Shapes: P devices on the leading axis, B sequences, S new tokens, D hidden, hd head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from models.families.plan import ShardingPlan, stacked_bias, stacked_weight
from models.sim.moe import Routing, layer_experts, moe_partials


@dataclass
class DTPCache:
    """Per-device KV cache: keys/values per layer, [P*B, G/L, T, hd]."""

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
    # x: [P, B, heads, S, hd]; cos/sin: [B, S, hd] -> [1, B, 1, S, hd]
    cos, sin = cos[None, :, None], sin[None, :, None]
    return x * cos + _rotate_half(x) * sin


class StackedWeights(Protocol):
    """A decoder's weights as P per-device slices: the planned linears stacked, the rest as is."""

    parts: int

    def linear(self, layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight [P, in, out], bias [P, 1, out] or None) of a planned linear, for `x @ weight`."""
        ...

    def tensor(self, layer: int, name: str) -> torch.Tensor:
        """A replicated tensor of the layer, e.g. 'input_layernorm.weight'."""
        ...


class ModelWeights:
    """The simulator's weights: views of a permuted HF model's parameters, split L ways by the plan."""

    def __init__(self, model: Any, plan: ShardingPlan, devices: int) -> None:
        self.parts = devices
        self.plan = plan
        layers: Any = model.model.layers
        self.layers: list[nn.Module] = list(layers)
        # Module objects are looked up once; their parameters are read at every call, so in-place
        # updates and `.data` replacements (permutation, training) are always seen.
        self.linears = [{name: layer.get_submodule(name) for name in plan.modules} for layer in self.layers]

    def linear(self, layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        lin: Any = self.linears[layer][module]
        style = self.plan.style(module)
        bias = stacked_bias(lin.bias, self.parts) if lin.bias is not None else None
        return stacked_weight(lin.weight, style, self.parts), bias

    def tensor(self, layer: int, name: str) -> torch.Tensor:
        return self.layers[layer].get_parameter(name)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [P, T, in]; weight: [P, in, out] -> [P, T, out]."""
    if bias is None:
        return torch.bmm(x, weight)
    return torch.baddbmm(bias, x, weight)


class ShardedDecoder:
    """The modules of a pre-norm GQA/SwiGLU decoder, per device, from each device's own stream."""

    def __init__(self, weights: StackedWeights, *, head_dim: int, eps: float, qk_norm: bool,
                 rotary_emb: nn.Module, routing: Routing | None = None) -> None:
        self.weights = weights
        self.routing = routing  # an MoE family's router (models.sim.moe); None: the dense SwiGLU FFN
        self.head_dim = head_dim
        self.eps = eps
        self.qk_norm = qk_norm
        self.rotary_emb = rotary_emb
        self.scaling = head_dim ** -0.5

    def rotary(self, input_ids: torch.Tensor, emb: torch.Tensor, past: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions past .. past+S: [B, S, hd] each."""
        B, S = input_ids.shape
        position_ids = torch.arange(past, past + S, device=input_ids.device).unsqueeze(0).expand(B, S)
        cos, sin = self.rotary_emb(emb, position_ids)
        return cos, sin

    def attention_heads(self, layer_idx: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        cache: DTPCache | None = None) -> torch.Tensor:
        """Each device's heads' attention outputs, before o_proj.

        x: [P, B, S, D] -> [P, B*S, heads*hd], head-major within a device.
        """
        P, B, S, D = x.shape
        hd, w = self.head_dim, self.weights
        h = rms_norm(x, w.tensor(layer_idx, "input_layernorm.weight"), self.eps).reshape(P, B * S, D)
        q = _linear(h, *w.linear(layer_idx, "self_attn.q_proj"))  # [P, B*S, heads*hd]
        k = _linear(h, *w.linear(layer_idx, "self_attn.k_proj"))  # [P, B*S, groups*hd]
        v = _linear(h, *w.linear(layer_idx, "self_attn.v_proj"))
        heads, groups = q.shape[-1] // hd, k.shape[-1] // hd
        q = q.view(P, B, S, heads, hd).transpose(2, 3)  # [P, B, heads, S, hd]
        k = k.view(P, B, S, groups, hd).transpose(2, 3)  # [P, B, groups, S, hd]
        v = v.view(P, B, S, groups, hd).transpose(2, 3)
        if self.qk_norm:
            q = rms_norm(q, w.tensor(layer_idx, "self_attn.q_norm.weight"), self.eps)
            k = rms_norm(k, w.tensor(layer_idx, "self_attn.k_norm.weight"), self.eps)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        q = q.reshape(P * B, heads, S, hd)
        k = k.reshape(P * B, groups, S, hd)
        v = v.reshape(P * B, groups, S, hd)
        past = 0
        if cache is not None:
            past = cache.layer_length(layer_idx)
            k, v = cache.update(layer_idx, k, v)  # [P*B, groups, past+S, hd]
        out = self._sdpa(q, k, v, past)  # [P*B, heads, S, hd]
        return out.view(P, B, heads, S, hd).transpose(2, 3).reshape(P, B * S, heads * hd)

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

    def attention_partials(self, layer_idx: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           cache: DTPCache | None = None) -> torch.Tensor:
        """Each device's partial output of attention `layer_idx` from its own stream.

        x: [P, B, S, D] residual streams -> [P, B, S, D] partials (over all L devices they sum to the
        dense output when all streams are equal).
        """
        P, B, S, D = x.shape
        heads_out = self.attention_heads(layer_idx, x, cos, sin, cache)  # [P, B*S, heads*hd]
        return _linear(heads_out, *self.weights.linear(layer_idx, "self_attn.o_proj")).view(P, B, S, D)

    def ffn_partials(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        """x: [P, B, S, D] -> [P, B, S, D]: device l's neurons applied to device l's stream."""
        P, B, S, D = x.shape
        w = self.weights
        h = rms_norm(x, w.tensor(layer_idx, "post_attention_layernorm.weight"), self.eps).reshape(P, B * S, D)
        if self.routing is not None:  # each device routes its own stream to its own slices of the experts
            return moe_partials(h, *layer_experts(w, layer_idx), self.routing).view(P, B, S, D)
        gate = _linear(h, *w.linear(layer_idx, "mlp.gate_proj"))  # [P, B*S, I/L]
        up = _linear(h, *w.linear(layer_idx, "mlp.up_proj"))
        act = F.silu(gate) * up
        return _linear(act, *w.linear(layer_idx, "mlp.down_proj")).view(P, B, S, D)

    def partials(self, n: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 cache: DTPCache | None = None) -> torch.Tensor:
        """Module n (attention of layer n // 2 when n is even, else its FFN): [P, B, S, D] partials."""
        if n % 2 == 0:
            return self.attention_partials(n // 2, x, cos, sin, cache)
        return self.ffn_partials(n // 2, x)
