"""The FFN units an affinity pass scores, as three matrices and a per-token weight, for either kind of FFN.

A dense SwiGLU FFN's units are its I neurons: gate and up rows [I, D], down columns [D, I], every token
weighted 1. A mixture-of-experts FFN's units are its experts' neurons, expert-major (u = e·I_e + j,
`models.families.moe`): the fused parameters read as gate/up [E·I_e, D] and down [D, E·I_e], and token t's
weight of unit u is the router's gate weight w_e(t) of u's expert, 0 where t does not reach e. Neuron u
writes w_e(t) α_u(t) w^d_u into the residual, so the first-order damage of removing head h's piece from
it is w_e(t) Δ_hu(t) (the paper's (5), scaled; the router's own response to the missing piece is a change
of routing, not of one neuron, and is left out as the rms change is), and the scores become

    up, FO:   Σ_{h∈g} E_t[w_e(t)² Δ_hu(t)²] ‖w^d_u‖²
    up, ADD:  Σ_{h∈g} E_t[w_e(t)² ((p_h·w^g_u)² + (p_h·w^u_u)²)]
    down:     E_t[w_e(t)² α_u(t)² / r'²] ‖W^qkv_g (γ' ⊙ w^d_u)‖²

(an expert a token does not reach costs it nothing). With every weight 1 they are the dense scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from models.families.moe import DOWN, GATE_UP, ROUTER
from models.sim.moe import Routing, gate_weights


@dataclass(frozen=True)
class FfnUnits:
    """A decoder layer's FFN as units: gate, up [U, D]; down [D, U]; the router where it is an MoE FFN."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    router: torch.Tensor | None = None  # [E, D]
    routing: Routing | None = None

    @property
    def experts(self) -> int:
        return 0 if self.router is None else int(self.router.shape[0])

    def token_weights(self, normed: torch.Tensor) -> torch.Tensor | None:
        """normed: [T, D] the FFN's normed input -> [T, U] each token's weight of each unit; None: all 1."""
        if self.router is None or self.routing is None:
            return None
        per_expert = gate_weights(normed, self.router, self.routing)  # [T, E]
        return per_expert.repeat_interleave(self.gate.shape[0] // self.experts, dim=1)  # [T, E·I_e]


def ffn_units(layer: Any, routing: Routing | None) -> FfnUnits:
    """The units of a (materialised) decoder layer's FFN; `routing` None: a dense FFN."""
    if routing is None:
        mlp = layer.mlp
        return FfnUnits(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    gate_up = layer.get_parameter(GATE_UP)  # [E, 2·I_e, D]
    _experts, two_i, D = gate_up.shape
    down = layer.get_parameter(DOWN)  # [E, D, I_e]
    return FfnUnits(gate=gate_up[:, : two_i // 2].reshape(-1, D), up=gate_up[:, two_i // 2 :].reshape(-1, D),
                    down=down.permute(1, 0, 2).reshape(D, -1), router=layer.get_parameter(ROUTER), routing=routing)
