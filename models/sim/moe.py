"""Each device's partial output of a mixture-of-experts FFN (issue 46), for the simulator and the runtime.

Under DTP every device keeps its own residual stream, so every device runs the (replicated) router on its
OWN normed stream: its own top-k experts and gate weights per token. Device l holds I_e/L neurons of every
expert (`models.families.moe`) and computes, from its stream x_l,

    o_l(t) = Σ_{e ∈ top-k_l(t)} w_{l,e}(t) · Σ_{j ∈ ν_l(e)} silu(h_l·w^g_{e,j}) (h_l·w^u_{e,j}) w^d_{e,j}

with h_l = RMSNorm(x_l) and (w_{l,e}, top-k_l) the router's choice on h_l: softmax over the E experts in fp32,
the k largest kept, renormalised where the family says so. The partials of the other devices fold in δ
modules later exactly as for the dense FFN (`models.sim.dtp`); with equal streams (tp) the L partials sum to
the dense MoE output, since every device then makes the same choice.

The expert weights arrive as the fused parameters of the (permuted) model, or of one rank's shard:
gate_up [E, 2·I', D] (an expert's I' gate rows, then its I' up rows) and down [E, D, I'], where I' is the
holder's neurons per expert (I_e for the whole model, I_e/L for a rank); device p of the P the holder
stands for holds positions [p·I'/P, (p+1)·I'/P) of each expert's gate, up and down. A rank's shard of
gate_up is its gate block followed by its up block, as vLLM's default MoE tensor parallelism holds w13.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from models.families.moe import DOWN, GATE_UP, ROUTER


@dataclass(frozen=True)
class Routing:
    """How a family's router picks: k experts per token, the k weights renormalised or not."""

    experts_per_token: int
    norm_topk_prob: bool


def routing_of(family: Any, config: Any) -> Routing | None:
    """The routing of an MoE family's config (`Family.moe`), None for a dense family."""
    moe = getattr(family, "moe", None)
    if moe is None:
        return None
    return Routing(moe.experts_per_token(config), moe.norm_topk_prob(config))


def route(h: torch.Tensor, router: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """The router on normed inputs h [..., D] with router weight [E, D], as transformers computes it:
    (weights [..., k] in h's dtype, expert indices [..., k])."""
    probs = torch.softmax((h @ router.t()).float(), dim=-1)  # [..., E], fp32
    weights, experts = torch.topk(probs, routing.experts_per_token, dim=-1)  # [..., k]
    if routing.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(h.dtype), experts


def gate_weights(h: torch.Tensor, router: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The router's weight of every expert for every token, 0 where the token does not reach it: [..., E]."""
    weights, experts = route(h, router, routing)
    return torch.zeros(*h.shape[:-1], router.shape[0], dtype=h.dtype, device=h.device).scatter(-1, experts, weights)


def device_experts(gate_up: torch.Tensor, down: torch.Tensor, parts: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused expert weights as P devices' slices: gate and up [P, E, I'/P, D], down [P, E, D, I'/P]."""
    E, two_i, D = gate_up.shape
    width = two_i // 2 // parts  # neurons of one expert on one device
    halves = gate_up.view(E, 2, parts, width, D)  # [E, gate|up, P, I'/P, D]
    gate = halves[:, 0].transpose(0, 1)  # [P, E, I'/P, D]
    up = halves[:, 1].transpose(0, 1)
    down_p = down.view(E, D, parts, width).permute(2, 0, 1, 3)  # [P, E, D, I'/P]
    return gate, up, down_p


def moe_partials(h: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 routing: Routing) -> torch.Tensor:
    """h: [P, T, D] each device's normed stream -> [P, T, D] each device's partial of the MoE FFN.

    Each device routes its own tokens, then each of its experts runs on the tokens that reach it (as
    transformers' experts loop does), weighted by the device's gate weight.
    """
    P, T, D = h.shape
    gate, up, down_p = device_experts(gate_up, down, P)
    weights, experts = route(h, router, routing)  # [P, T, k]
    outs = []
    for p in range(P):
        out = torch.zeros(T, D, dtype=h.dtype, device=h.device)
        for e in torch.unique(experts[p]).tolist():
            token, slot = torch.nonzero(experts[p] == e, as_tuple=True)  # the tokens of device p routed to e
            x_e = h[p, token]  # [n, D]
            act = F.silu(x_e @ gate[p, e].t()) * (x_e @ up[p, e].t())  # [n, I'/P]
            out = out.index_add(0, token, (act @ down_p[p, e].t()) * weights[p, token, slot, None])
        outs.append(out)
    return torch.stack(outs)  # [P, T, D]


def layer_experts(weights: Any, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(router [E, D], gate_up [E, 2·I', D], down [E, D, I']) of a decoder layer from its weights holder."""
    return weights.tensor(layer_idx, ROUTER), weights.tensor(layer_idx, GATE_UP), weights.tensor(layer_idx, DOWN)


def expert_orders(neuron_order: Any, num_experts: int, expert_size: int) -> torch.Tensor:
    """A layer's neuron order over the E·I_e expert-major units (`Layout.neuron_order`: each expert's
    neurons stay in its own block) as each expert's local order: [E, I_e], row e a permutation of 0..I_e-1."""
    order = torch.as_tensor(neuron_order, dtype=torch.long).view(num_experts, expert_size)  # [E, I_e]
    local = order - torch.arange(num_experts)[:, None] * expert_size
    if (local.sort(dim=1).values != torch.arange(expert_size)).any():
        raise ValueError("neuron order moves a neuron between experts: an MoE layout permutes each expert's "
                         f"{expert_size} neurons among themselves (units e·{expert_size} + j, j < {expert_size})")
    return local


@torch.no_grad()
def reorder_experts_(layer: Any, local: torch.Tensor) -> None:
    """Put neuron local[e, p] of expert e at position p, in place: the gate and up rows of the fused
    gate_up [E, 2·I_e, D] and the columns of down [E, D, I_e] (the router and norms do not move)."""
    gate_up, down = layer.get_parameter(GATE_UP), layer.get_parameter(DOWN)
    I_e = local.shape[1]
    local = local.to(gate_up.device)
    rows = torch.cat([local, local + I_e], dim=1)  # [E, 2·I_e]: the gate block, then the up block
    gate_up.data = gate_up.data.gather(1, rows[:, :, None].expand(-1, -1, gate_up.shape[2])).contiguous()
    down.data = down.data.gather(2, local[:, None, :].expand(-1, down.shape[1], -1)).contiguous()
