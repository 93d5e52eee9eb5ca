"""A model's shape as a layout sees it: layers, KV groups, query heads, FFN width (and hidden size, head dim).

Read from a model's config by `models.families.model_shape`; held by layouts, affinity files and the
simulator. Dependency-free (on the ground floor of models/: docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    num_layers: int
    num_kv_groups: int
    num_query_heads: int
    intermediate_size: int
    hidden_size: int = 0
    head_dim: int = 0
    # A mixture-of-experts FFN (issue 46): E experts of expert_size = I_e neurons, k routed per token; its
    # units are the experts' neurons expert-major (u = e·I_e + j), so intermediate_size = E·I_e. 0: dense.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0

    @property
    def heads_per_group(self) -> int:
        return self.num_query_heads // self.num_kv_groups

    @property
    def neuron_blocks(self) -> int:
        """The blocks of FFN units each balanced over the devices on its own: the experts, or 1 (dense)."""
        return max(1, self.num_experts)

    @property
    def block_size(self) -> int:
        """The units of one block: an expert's neurons (I_e), or the dense FFN's width."""
        return self.intermediate_size // self.neuron_blocks
