"""Mixture-of-experts FFNs (issue 46): what a family with routed experts declares (`Family.moe`).

An MoE layer's FFN is a router (`gate`, [E, D]) and E SwiGLU experts of I_e neurons each. For a token t
with normed input h_t the router takes the softmax of h_t W_rᵀ over the E experts (in fp32), keeps the
top k, and renormalises the k kept weights to sum to one where the family says so (Mixtral always;
Qwen3-MoE when `norm_topk_prob`); the FFN's output is Σ_{e ∈ top-k(t)} w_e(t) · expert_e(h_t).

The unit of a layout (issue 46's convention, shared by the simulator, the affinity, the optimiser and the
export): the experts' intermediate neurons, expert-major, unit u = e·I_e + j (expert e, neuron j < I_e).
A layout's per-layer neuron array has E·I_e entries (`ModelShape.intermediate_size`) and puts exactly
I_e/L neurons of EVERY expert on each device, which is vLLM's default MoE tensor parallelism (each rank
holds 1/L of every expert). The router and the norms are replicated: under DTP every device routes its
own stream.

In memory (transformers ≥ 5) both families hold the experts fused, relative to a decoder layer:
`mlp.gate.weight` [E, D], `mlp.experts.gate_up_proj` [E, 2·I_e, D] (an expert's I_e gate rows, then its
I_e up rows) and `mlp.experts.down_proj` [E, D, I_e]. `save_pretrained` writes the families' original
per-expert names (`checkpoint`), which is what a checkpoint directory holds. This module imports no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

ExpertRole = Literal["gate", "up", "down"]
EXPERT_ROLES: tuple[ExpertRole, ...] = ("gate", "up", "down")


@dataclass(frozen=True)
class ExpertNames:
    """An MoE block's tensor names relative to a decoder layer; `{e}` stands for the expert's index."""

    router: str  # [E, D]
    gate: str  # [I_e, D] per expert: column-parallel by neuron
    up: str  # [I_e, D]
    down: str  # [D, I_e]: row-parallel by neuron

    def role_of(self, relative: str) -> tuple[ExpertRole, int] | None:
        """(role, expert) of a per-expert tensor name relative to its layer, else None."""
        for role in EXPERT_ROLES:
            pattern = re.escape(getattr(self, role)).replace(r"\{e\}", r"(\d+)")
            match = re.fullmatch(pattern, relative)
            if match:
                return role, int(match[1])
        return None


# The fused in-memory parameters, relative to a decoder layer (both families, transformers ≥ 5).
ROUTER = "mlp.gate.weight"
GATE_UP = "mlp.experts.gate_up_proj"  # [E, 2·I_e, D]: gate rows [0, I_e), up rows [I_e, 2·I_e)
DOWN = "mlp.experts.down_proj"  # [E, D, I_e]


@dataclass(frozen=True, kw_only=True)
class MoeFfn:
    """Where a family's config keeps its MoE facts, how its router normalises, and its checkpoint names."""

    num_experts_field: str  # E
    expert_size_field: str  # I_e, the neurons of one expert
    experts_per_token_field: str = "num_experts_per_tok"  # k
    # The config field that says whether the top-k weights are renormalised; None: always (Mixtral).
    norm_topk_prob_field: str | None = None
    checkpoint: ExpertNames  # save_pretrained's per-expert names

    def num_experts(self, config: Any) -> int:
        return int(getattr(config, self.num_experts_field))

    def expert_size(self, config: Any) -> int:
        return int(getattr(config, self.expert_size_field))

    def experts_per_token(self, config: Any) -> int:
        return int(getattr(config, self.experts_per_token_field))

    def norm_topk_prob(self, config: Any) -> bool:
        return True if self.norm_topk_prob_field is None else bool(getattr(config, self.norm_topk_prob_field))

    def refusals(self, config: Any) -> list[str]:
        """What the simulator cannot run exactly: experts or top-k out of range, router training noise."""
        reasons = []
        experts, k, size = (getattr(config, f, None) for f in (self.num_experts_field, self.experts_per_token_field,
                                                                self.expert_size_field))
        if not isinstance(experts, int) or experts < 1:
            reasons.append(f"{self.num_experts_field}={experts!r} (an MoE family needs at least one expert)")
        elif not isinstance(k, int) or not 1 <= k <= experts:
            reasons.append(f"{self.experts_per_token_field}={k!r} (must be in [1, {self.num_experts_field}={experts}])")
        if not isinstance(size, int) or size < 1:
            reasons.append(f"{self.expert_size_field}={size!r} (each expert needs at least one neuron)")
        if getattr(config, "router_jitter_noise", 0.0):
            reasons.append(f"router_jitter_noise={config.router_jitter_noise} (training noise on the router input, "
                           "which the simulator does not model: 0.0 is accepted)")
        return reasons
