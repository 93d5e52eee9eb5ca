"""The Delayed Tensor Parallelism forward (§2 of the paper) for L virtual devices on one machine.

Modules are numbered n = 0 .. 2N-1 (attention of layer i is 2i, its FFN 2i+1). Device l keeps its
own residual stream X_l and, after module n, adds its own partial o_n^l at once and the other
devices' partials of module n-δ:

    n < δ:              X_l += √L · o_n^l                                  (1)
    δ ≤ n < 2N-δ:       X_l += o_n^l + Σ_{j≠l} o_{n-δ}^j                   (2)
    n ≥ 2N-δ:           X_l += √L · o_n^l + Σ_{j≠l} o_{n-δ}^j              (3)

The final norm is applied per device and the L outputs are averaged. The model must already be
permuted (`models.permute.permute_`) so that device l's shard is the l-th contiguous slice; the
shards are views of the model's own parameters, so autograd trains the wrapped model. The module
math is `models.partials` (shared with the multi-process runtime, `models.runtime`) and the
recurrence's schedule is `DTPSchedule` (also shared).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.families import family_for_config, model_shape
from models.layouts.layout import check_delta, check_devices
from models.partials import DTPCache, ModelWeights, ShardedDecoder, rms_norm

__all__ = ["DTPCache", "DTPModel", "DTPSchedule", "LastScale", "rms_norm"]

LastScale = Literal["sqrt", "one"]


@dataclass(frozen=True)
class DTPSchedule:
    """When each partial is added: equations (1)-(3) as a schedule over modules n = 0 .. 2N-1."""

    devices: int
    delta: int
    num_modules: int
    last_scale: LastScale = "sqrt"

    def __post_init__(self) -> None:
        if self.last_scale not in ("sqrt", "one"):
            raise ValueError(f"last_scale must be 'sqrt' or 'one', got {self.last_scale!r}")

    def own_scale(self, n: int) -> float:
        """√L on the first δ modules and (unless last_scale='one') on the last δ, else 1."""
        root = math.sqrt(self.devices)
        if n < self.delta:
            return root
        if n >= self.num_modules - self.delta and self.last_scale == "sqrt":
            return root
        return 1.0

    def late(self, n: int) -> int | None:
        """The module whose other-device partials are added right after module n (n - δ), if any."""
        return n - self.delta if n >= self.delta else None

    def exchanged(self, m: int) -> bool:
        """Whether module m's partial is ever added on the other devices (the last δ ones never are)."""
        return m < self.num_modules - self.delta


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
        self.schedule = DTPSchedule(devices, delta, 2 * self.shape.num_layers, last_scale)
        self.model = model
        self.devices = devices
        self.delta = delta
        self.last_scale = last_scale
        self.gradient_checkpointing = gradient_checkpointing
        self.eps = float(config.rms_norm_eps)
        self.num_modules = 2 * self.shape.num_layers
        self.scaling = self.shape.head_dim ** -0.5
        self.decoder = ShardedDecoder(ModelWeights(model, self.family.plan, devices), head_dim=self.shape.head_dim,
                                      eps=self.eps, qk_norm=self.family.qk_norm,
                                      rotary_emb=model.model.rotary_emb)

    # ---- module partials (models.partials) ------------------------------------------------------
    def attention_partials(self, layer_idx: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           cache: DTPCache | None = None) -> torch.Tensor:
        """x: [L, B, S, D] residual streams -> [L, B, S, D] partials of attention `layer_idx`."""
        return self.decoder.attention_partials(layer_idx, x, cos, sin, cache)

    def attention_heads(self, layer_idx: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        cache: DTPCache | None = None) -> torch.Tensor:
        """x: [L, B, S, D] -> [L, B*S, (H/L)*hd], each device's heads before o_proj."""
        return self.decoder.attention_heads(layer_idx, x, cos, sin, cache)

    def ffn_partials(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        """x: [L, B, S, D] -> [L, B, S, D]: device l's neurons applied to device l's stream."""
        return self.decoder.ffn_partials(layer_idx, x)

    def rotary(self, input_ids: torch.Tensor, emb: torch.Tensor, past: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions past .. past+S: [B, S, hd] each."""
        return self.decoder.rotary(input_ids, emb, past)

    # ---- the DTP recurrence -----------------------------------------------------------------
    def own_scale(self, n: int) -> float:
        """√L on the first δ modules and (unless last_scale='one') on the last δ, else 1."""
        return self.schedule.own_scale(n)

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
        own: dict[int, torch.Tensor] = {}  # partials waiting to be added on the other devices, [L, B, S, D]
        for n in range(self.num_modules):
            partial = self._module(n, x, cos, sin, cache)
            scale = self.schedule.own_scale(n)
            x = x + (partial * scale if scale != 1.0 else partial)
            if self.schedule.exchanged(n):
                own[n] = partial
            late = self.schedule.late(n)
            if late is not None:
                o = own.pop(late)  # module n-δ, arriving now from the other devices
                x = x + (o.sum(0, keepdim=True) - o)
        h = rms_norm(x, inner.norm.weight, self.eps)  # [L, B, S, D]
        return h.mean(0)

    def forward(self, input_ids: torch.Tensor, cache: DTPCache | None = None) -> torch.Tensor:
        """input_ids: [B, S] -> logits [B, S, V] (lm_head is linear, so averaging before it is exact)."""
        logits: torch.Tensor = self.model.lm_head(self.hidden_states(input_ids, cache))
        return logits
