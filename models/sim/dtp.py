"""The Delayed Tensor Parallelism forward (§2 of the paper) for L virtual devices on one machine, under
any communication schedule (`models.schedules.grammar`: tp, dtp:δ, dtp:δ@K, ladder, spd:B, pt:D).

Modules are numbered n = 0 .. 2N-1 (attention of layer i is 2i, its FFN 2i+1). Device l keeps its
own residual stream X_l. Before module t it holds

    X_l = X^(0) + Σ_{b_n ≤ t} s_n · o_n^l + Σ_{a_n ≤ t} Σ_{j≠l} o_n^j

(b_n, s_n, a_n: the schedule's own arrival, own scale and others' arrival of module n). At dtp:δ,
the paper's equations, after module n:

    n < δ:              X_l += √L · o_n^l                                  (1)
    δ ≤ n < 2N-δ:       X_l += o_n^l + Σ_{j≠l} o_{n-δ}^j                   (2)
    n ≥ 2N-δ:           X_l += √L · o_n^l + Σ_{j≠l} o_{n-δ}^j              (3)

The final norm is applied per device and the L outputs are averaged. The model must already be
permuted (`models.sim.permute.permute_`) so that device l's shard is the l-th contiguous slice; the
shards are views of the model's own parameters, so autograd trains the wrapped model. The module
math is `models.sim.partials` (shared with the multi-process runtime, `models.runtime`); the runtime
reads the dtp schedule through `DTPSchedule`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.families import family_for_config, model_shape
from models.layouts.layout import check_delta, check_devices
from models.schedules.grammar import LastScale, Schedule, ScheduleError, ScheduleSpec, dtp_spec, resolve_schedule
from models.sim.moe import routing_of
from models.sim.partials import DTPCache, ModelWeights, ShardedDecoder, rms_norm

__all__ = ["GATHERED", "DTPCache", "DTPModel", "DTPSchedule", "LastScale", "gathered", "rms_norm"]

# The method through which the simulator reads a module's weights outside its `forward()`: under FSDP2
# (`models.distill.sharding`) it is registered with `register_fsdp_forward_method`, so that the module's
# sharded parameters are all-gathered before the call (and resharded, and their gradients
# reduce-scattered, as after a forward); unsharded, a module has no such method and `gathered` calls
# straight through.
GATHERED = "gathered"


def gathered(module: nn.Module, fn: Any, *args: Any) -> Any:
    """fn(*args) with `module`'s parameters whole: through its registered FSDP method where it has one."""
    gate = getattr(module, GATHERED, None)
    return gate(fn, *args) if gate is not None else fn(*args)


def call_through(module: nn.Module, fn: Any, *args: Any) -> Any:
    """The body of a `GATHERED` method of `module`: the FSDP hooks around it do the gathering."""
    return fn(*args)


@dataclass(frozen=True)
class DTPSchedule:
    """The runtime's view of `dtp:δ` (one late module per step): equations (1)-(3), read from the table."""

    devices: int
    delta: int
    num_modules: int
    last_scale: LastScale = "sqrt"
    table: Schedule = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.last_scale not in ("sqrt", "one"):
            raise ValueError(f"last_scale must be 'sqrt' or 'one', got {self.last_scale!r}")
        table = dtp_spec(self.delta).resolve(self.num_modules // 2, self.devices, self.last_scale)
        object.__setattr__(self, "table", table)

    def own_scale(self, n: int) -> float:
        """√L on the first δ modules and (unless last_scale='one') on the last δ, else 1."""
        return self.table.own_scale[n]

    def late(self, n: int) -> int | None:
        """The module whose other-device partials are added right after module n (n - δ), if any."""
        arriving = self.table.others_arriving(n + 1)
        return arriving[0] if arriving else None

    def exchanged(self, m: int) -> bool:
        """Whether module m's partial is ever added on the other devices (the last δ ones never are)."""
        return self.table.exchanged(m)


# One step of the recurrence before module t: add module m's own partial (scaled), the other devices'
# partials, or both at once when they arrive together unscaled (the full sum, what an all-reduce gives).
_OWN, _OTHERS, _ALL = "own", "others", "all"


def _arrival_plan(schedule: Schedule) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Per t = 1 .. M (index t-1): the additions before module t, own partials first then the others'
    (the order today's dtp recurrence adds them in, so that dtp:δ's float sums are unchanged)."""
    plan = []
    for t in range(1, schedule.num_modules + 1):
        others = schedule.others_arriving(t)
        steps = []
        for m in schedule.own_arriving(t):
            together = m in others and schedule.own_scale[m] == 1.0
            steps.append((_ALL if together else _OWN, m))
        steps += [(_OTHERS, m) for m in others if (_ALL, m) not in steps]
        plan.append(tuple(steps))
    return tuple(plan)


def _last_use(schedule: Schedule) -> tuple[int, ...]:
    """Per module: the arrival point after which its partial is no longer needed."""
    pairs = zip(schedule.own_arrival, schedule.other_arrival, strict=True)
    return tuple(max(b, a if a is not None else b) for b, a in pairs)


@dataclass
class Streams:
    """The L devices' residual streams of one micro-batch during the recurrence."""

    x: torch.Tensor  # [L, B, S, D]
    cos: torch.Tensor  # [B, S, hd]
    sin: torch.Tensor
    held: dict[int, torch.Tensor] = field(default_factory=dict)  # module → partials still to arrive somewhere


class DTPModel(nn.Module):
    """DTP simulator over a (permuted) Hugging Face causal LM of a supported family."""

    model: Any  # a transformers causal LM (duck-typed: model.model.layers, lm_head, config)

    def __init__(self, model: Any, *, devices: int, delta: int | None = None,
                 schedule: str | ScheduleSpec | None = None, last_scale: LastScale = "sqrt",
                 gradient_checkpointing: bool = False) -> None:
        """Give `schedule` (a string such as 'pt:2', or a parsed spec) or `delta` (short for dtp:δ)."""
        super().__init__()
        config = model.config
        self.family = family_for_config(config)
        self.shape = model_shape(config)
        check_devices(self.shape, devices)
        if (delta is None) == (schedule is None):
            raise ScheduleError("give the schedule or delta (short for dtp:δ), exactly one of them")
        if delta is not None:
            check_delta(self.shape, delta)
            schedule = dtp_spec(delta)
        assert schedule is not None
        self.schedule: Schedule = resolve_schedule(schedule, self.shape.num_layers, devices, last_scale)
        self._plan = _arrival_plan(self.schedule)
        self._last_use = _last_use(self.schedule)
        self.model = model
        self.layers: list[nn.Module] = list(model.model.layers)  # a plain list: not registered twice
        self.devices = devices
        self.delta = delta  # None unless given as the shorthand
        self.last_scale = last_scale
        self.gradient_checkpointing = gradient_checkpointing
        self.eps = float(config.rms_norm_eps)
        self.num_modules = 2 * self.shape.num_layers
        self.scaling = self.shape.head_dim ** -0.5
        self.decoder = ShardedDecoder(ModelWeights(model, self.family.plan, devices), head_dim=self.shape.head_dim,
                                      eps=self.eps, qk_norm=self.family.qk_norm,
                                      rotary_emb=model.model.rotary_emb, routing=routing_of(self.family, config))

    def gathered(self, fn: Any, *args: Any) -> Any:
        """fn(*args): the root's `GATHERED` method (embeddings, final norm, LM head whole under FSDP2)."""
        return call_through(self, fn, *args)

    # ---- module partials (models.sim.partials) ------------------------------------------------------
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
        return self.schedule.own_scale[n]

    def _module(self, n: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: DTPCache | None) -> torch.Tensor:
        """Module n's partials, read through its decoder layer's `GATHERED` method (FSDP2 unit)."""
        out: torch.Tensor = gathered(self.layers[n // 2], self._module_partials, n, x, cos, sin, cache)
        return out

    def _module_partials(self, n: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
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
        stream = self.start(input_ids, cache)
        for n in range(self.num_modules):
            self.step(n, stream, cache)
        return self.finish(stream)

    # The recurrence in three parts, so that a pass fed the model layer by layer (models.evaluation.evaluate
    # over a streamed source) runs module n on every micro-batch before reading module n+1's weights.
    def start(self, input_ids: torch.Tensor, cache: DTPCache | None = None) -> Streams:
        """The L device streams at the embeddings, before module 0."""
        emb = self.model.model.embed_tokens(input_ids)  # [B, S, D]
        cos, sin = self.rotary(input_ids, emb, cache.length if cache is not None else 0)  # [B, S, hd]
        return Streams(emb.unsqueeze(0).expand(self.devices, *emb.shape), cos, sin)  # x: [L, B, S, D]

    def step(self, n: int, stream: Streams, cache: DTPCache | None = None) -> None:
        """Module n on every device's stream, then the partials that arrive before module n+1."""
        held = stream.held  # partials not yet added everywhere they go, [L, B, S, D]
        held[n] = self._module(n, stream.x, stream.cos, stream.sin, cache)
        x = stream.x
        t = n + 1  # the arrivals before module t (t = M: before the final norm)
        for kind, m in self._plan[n]:
            o = held[m]
            if kind == _OWN:
                scale = self.schedule.own_scale[m]
                x = x + (o * scale if scale != 1.0 else o)
            elif kind == _OTHERS:
                x = x + (o.sum(0, keepdim=True) - o)
            else:
                x = x + o.sum(0, keepdim=True)
        stream.x = x
        for m in [m for m in held if self._last_use[m] <= t]:
            del held[m]

    def finish(self, stream: Streams) -> torch.Tensor:
        """The final norm per device, averaged over the devices: [B, S, D]."""
        h = rms_norm(stream.x, self.model.model.norm.weight, self.eps)  # [L, B, S, D]
        return h.mean(0)

    def forward(self, input_ids: torch.Tensor, cache: DTPCache | None = None) -> torch.Tensor:
        """input_ids: [B, S] -> logits [B, S, V] (lm_head is linear, so averaging before it is exact)."""
        logits: torch.Tensor = self.model.lm_head(self.hidden_states(input_ids, cache))
        return logits
