"""An MoE model's checkpoint tensors (issue 46): the per-expert names `save_pretrained` writes, read from the
fused parameters a loaded model holds, with each expert's split into rank slices and its permutation.

transformers (≥ 5) holds a layer's experts fused (`models.families.moe`: `mlp.experts.gate_up_proj`
[E, 2·I_e, D], `mlp.experts.down_proj` [E, D, I_e], the router `mlp.gate.weight` [E, D]); a checkpoint
directory holds them one expert at a time under the family's own names (`Family.moe.checkpoint`: Qwen3-MoE's
`mlp.experts.{e}.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.{e}.w1.weight`, …), which is what
`from_pretrained`, vLLM and every other reader load. The export writes those names, so its `checkpoint/` is
what `save_pretrained` of the permuted model writes and its rank shards carry the same names sliced.

The unit is the convention of `models.families.moe`: expert e's neuron j is unit e·I_e + j of the layer's
neuron array. Realising a layout permutes each expert's neurons on their own (the stable sort of the expert's
I_e neurons by device, `models.sim.moe.expert_orders`, the simulator's own permutation: a balanced layout
puts I_e/L of them on every device), so rank r's slice of every
expert is rows (gate, up) or columns (down) [r·I_e/L, (r+1)·I_e/L): vLLM's default MoE tensor parallelism.
The router is replicated. A dense family has no expert tensors and everything here passes its names through.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from models.families.moe import DOWN, GATE_UP, ROUTER, ExpertNames
from models.families.plan import SplitRule
from models.layouts.layout import Layout
from models.sim.moe import expert_orders

__all__ = ["CheckpointTensors", "ExpertTensor"]

_LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+))\.(?P<rel>.+)$")
Role = Literal["router", "gate", "up", "down"]
Entry = tuple[str, tuple[int, ...]]  # a checkpoint tensor's name and shape
# How each per-expert role splits over the ranks: the gate and up rows and the down columns move with the neuron.
_RULES: dict[Role, SplitRule] = {"router": "replicated", "gate": "rows", "up": "rows", "down": "cols"}


@dataclass(frozen=True)
class ExpertTensor:
    """One checkpoint tensor of an MoE block and where the loaded model keeps it."""

    layer: int
    role: Role
    expert: int | None  # None: the router
    fused: str  # the loaded model's tensor (state-dict name) it is a slice of, or is (the router)


class CheckpointTensors:
    """A model's checkpoint tensors from the names and shapes of its state dict: a dense family's as they are,
    an MoE family's fused experts as the per-expert tensors of its checkpoint names."""

    def __init__(self, family: Any, state_entries: Iterable[Entry]) -> None:
        moe = getattr(family, "moe", None)
        self.family = family
        self.names: ExpertNames | None = moe.checkpoint if moe is not None else None
        self.entries: list[Entry] = []
        self.experts: dict[str, ExpertTensor] = {}  # checkpoint name -> what it is
        self.num_experts = 0
        self._last: tuple[str, torch.Tensor] | None = None  # the fused tensor `tensor` read last, by its name
        for name, shape in state_entries:
            for entry, expert in self._expand(name, tuple(shape)):
                self.entries.append(entry)
                if expert is not None:
                    self.experts[entry[0]] = expert

    def _expand(self, name: str, shape: tuple[int, ...]) -> list[tuple[Entry, ExpertTensor | None]]:
        match = _LAYER.match(name)
        if self.names is None or match is None or match["rel"] not in (ROUTER, GATE_UP, DOWN):
            return [((name, shape), None)]
        prefix, layer, rel = match["prefix"], int(match["layer"]), match["rel"]
        names = self.names
        if rel == ROUTER:
            self.num_experts = shape[0]
            return [((f"{prefix}.{names.router}", shape), ExpertTensor(layer, "router", None, name))]
        experts = shape[0]
        if rel == GATE_UP:  # [E, 2·I_e, D] -> per expert gate [I_e, D], up [I_e, D]
            size = shape[1] // 2
            return [((f"{prefix}.{getattr(names, role).format(e=e)}", (size, shape[2])),
                     ExpertTensor(layer, role, e, name)) for e in range(experts) for role in ("gate", "up")]
        return [((f"{prefix}.{names.down.format(e=e)}", (shape[1], shape[2])),  # [E, D, I_e] -> [D, I_e] each
                 ExpertTensor(layer, "down", e, name)) for e in range(experts)]

    @property
    def is_moe(self) -> bool:
        return bool(self.experts)

    def tensor(self, name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """Checkpoint tensor `name`, from `read` (a loaded model's tensor by its state-dict name)."""
        expert = self.experts.get(name)
        if expert is None:
            return read(name)
        if self._last is None or self._last[0] != expert.fused:  # a layer's experts are read once, not once each
            self._last = (expert.fused, read(expert.fused))
        fused = self._last[1]
        if expert.role == "router":
            return fused
        if expert.role == "down":
            return fused[expert.expert]  # [D, I_e]
        size = fused.shape[1] // 2
        rows = slice(0, size) if expert.role == "gate" else slice(size, 2 * size)
        return fused[expert.expert, rows]  # [I_e, D]

    def rule(self, name: str) -> SplitRule:
        """'rows', 'cols' or 'replicated': an expert tensor's by its role, any other by the family's plan."""
        expert = self.experts.get(name)
        return _RULES[expert.role] if expert is not None else self.family.plan.rule(name)

    def split_rules(self) -> dict[str, SplitRule]:
        """The manifest's `split`: every checkpoint tensor's rule."""
        return {name: self.rule(name) for name, _ in self.entries}

    def permuted(self, name: str, tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
        """An expert tensor with its neurons in `layout`'s order; the router unchanged. For expert tensors only
        (`name in self.experts`)."""
        expert = self.experts[name]
        if expert.expert is None:
            return tensor
        dim = 1 if expert.role == "down" else 0
        # the simulator's permutation of the same layer (models.sim.moe): expert e's local order, [I_e]
        order = expert_orders(layout.neuron_order(expert.layer), self.num_experts, tensor.shape[dim])[expert.expert]
        return tensor.index_select(dim, order.to(tensor.device)).contiguous()

    def fused_state(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A checkpoint's tensors (by checkpoint name) as the loaded model holds them: each layer's experts
        stacked back into its fused parameters (the inverse of `tensor`)."""
        out = {name: t for name, t in state.items() if name not in self.experts}
        parts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
        for name, expert in self.experts.items():
            if expert.expert is None:
                out[expert.fused] = state[name]
            else:
                parts.setdefault(expert.fused, {})[(expert.expert, expert.role)] = state[name]
        for fused, pieces in parts.items():
            experts = 1 + max(e for e, _ in pieces)
            if fused.endswith(GATE_UP):  # [E, 2·I_e, D]
                out[fused] = torch.stack([torch.cat([pieces[(e, "gate")], pieces[(e, "up")]]) for e in range(experts)])
            else:  # [E, D, I_e]
                out[fused] = torch.stack([pieces[(e, "down")] for e in range(experts)])
        return out
