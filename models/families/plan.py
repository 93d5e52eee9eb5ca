"""The sharding plan: how each linear of a decoder layer splits over the L devices, declared once.

A family lists its sharded linears by module name (relative to a decoder layer) with a parallel
style, as gpt-fast's `tp.py` and torchtitan's parallel plans do:

- `Colwise(unit)`: column-parallel, the output features are split: weight rows (and the bias) move
  with the unit that owns them, and each device produces its own slice of the output.
- `Rowwise(unit)`: row-parallel, the input features are split: weight columns move with the unit,
  and each device produces a partial of the full output (the partials sum to the dense output).

The unit is a KV group or an FFN neuron. Along the split dimension a module holds `units`
equal contiguous blocks, one per unit in storage order, so the rows a unit owns follow from the
module's size alone: a KV group owns `hd` rows of k/v and `(H/G)·hd` rows of q, because a
Hugging Face GQA model reads query head h against KV head h // (H/G), so the query heads of a
group are consecutive and follow it. Every tensor the plan does not name (embeddings, norms, q/k
norm gains, the LM head) is replicated.

Everything else is derived from the plan: the permutation that realises a layout
(`models.sim.permute`), the simulator's per-device views (`models.sim.partials`), the export's split into
rank shards and the manifest's `split` rules (`models.export.writer`), and the runtime's check of each
rank's tensors (`models.runtime`). This module imports no torch: the API process reads families.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Unit = Literal["kv_group", "neuron"]
SplitRule = Literal["rows", "cols", "replicated"]
UNITS: tuple[Unit, ...] = ("kv_group", "neuron")

_LAYER_PARAM = re.compile(r"^(?P<prefix>.*\.layers\.(?P<layer>\d+))\.(?P<module>.+)\.(?P<kind>weight|bias)$")


class PlanError(ValueError):
    """A checkpoint does not fit its family's sharding plan (e.g. a row-parallel bias)."""


@dataclass(frozen=True)
class Colwise:
    """Column-parallel: output features split; weight rows and bias entries move with `unit`."""

    unit: Unit
    dim = 0  # the weight dimension ([out, in]) that is split
    name = "colwise"


@dataclass(frozen=True)
class Rowwise:
    """Row-parallel: input features split; weight columns move with `unit`; each device outputs a partial."""

    unit: Unit
    dim = 1
    name = "rowwise"


ParallelStyle = Colwise | Rowwise


@dataclass(frozen=True)
class ShardingPlan:
    """Module name (relative to a decoder layer) → parallel style. Unnamed tensors are replicated."""

    modules: Mapping[str, ParallelStyle]

    def __post_init__(self) -> None:
        for module, style in self.modules.items():
            if not isinstance(style, Colwise | Rowwise) or style.unit not in UNITS:
                raise PlanError(f"plan entry {module!r}: expected Colwise/Rowwise of {UNITS}, got {style!r}")

    def style(self, module: str) -> ParallelStyle:
        return self.modules[module]

    def modules_of(self, unit: Unit) -> list[tuple[str, ParallelStyle]]:
        return [(m, s) for m, s in self.modules.items() if s.unit == unit]

    def rule(self, param_name: str) -> SplitRule:
        """'rows', 'cols' or 'replicated' for a checkpoint tensor name (e.g. model.layers.3.mlp.up_proj.weight)."""
        match = _LAYER_PARAM.match(param_name)
        if match is None or match["module"] not in self.modules:
            return "replicated"
        style = self.modules[match["module"]]
        if match["kind"] == "bias":
            if isinstance(style, Rowwise):
                # A row-parallel bias would be added once per device: no device owns it under DTP.
                raise PlanError(f"{param_name}: a bias on the row-parallel {match['module']} has no owning device")
            return "rows"
        return "rows" if isinstance(style, Colwise) else "cols"

    def planned(self, param_name: str) -> tuple[int, str, ParallelStyle, str] | None:
        """(layer, module, style, 'weight' | 'bias') of a planned linear's checkpoint tensor, else None."""
        match = _LAYER_PARAM.match(param_name)
        if match is None or match["module"] not in self.modules:
            return None
        return int(match["layer"]), match["module"], self.modules[match["module"]], match["kind"]

    def split_rules(self, param_names: Iterable[str]) -> dict[str, SplitRule]:
        """The manifest's `split`: the rule of every checkpoint tensor."""
        return {name: self.rule(name) for name in param_names}

    def to_json_dict(self) -> dict[str, Any]:
        """What the manifest records (informational: a reader derives the plan from the family)."""
        return {m: {"parallel": s.name, "unit": s.unit} for m, s in self.modules.items()}


# ---- what a rule does to a tensor (duck-typed: works on torch tensors without importing torch here) ----

def split_dim(rule: SplitRule) -> int | None:
    return {"rows": 0, "cols": 1}.get(rule)


def local_shape(full_shape: tuple[int, ...], rule: SplitRule, devices: int) -> tuple[int, ...]:
    """The shape of one rank's slice of a tensor of `full_shape`."""
    dim = split_dim(rule)
    if dim is None:
        return tuple(full_shape)
    shape = list(full_shape)
    if shape[dim] % devices:
        raise PlanError(f"dimension {dim} of size {shape[dim]} does not split over {devices} devices")
    shape[dim] //= devices
    return tuple(shape)


def rank_slice(tensor: Any, rule: SplitRule, rank: int, devices: int) -> Any:
    """Device `rank`'s contiguous slice of a (permuted) full tensor."""
    dim = split_dim(rule)
    return tensor if dim is None else tensor.chunk(devices, dim=dim)[rank]


def stacked_weight(weight: Any, style: ParallelStyle, parts: int) -> Any:
    """A linear's weight as `parts` per-device matrices, ready for a batched matmul `x @ w`.

    weight: the full [out, in] weight (parts = L, the simulator) or one rank's slice (parts = 1).
    Colwise -> [parts, in, out/parts]; Rowwise -> [parts, in/parts, out].
    """
    if isinstance(style, Colwise):
        return weight.view(parts, -1, weight.shape[1]).transpose(1, 2)
    return weight.view(weight.shape[0], parts, -1).permute(1, 2, 0)


def stacked_bias(bias: Any, parts: int) -> Any:
    """A column-parallel bias as [parts, 1, out/parts]."""
    return bias.view(parts, 1, -1)


# ---- the plan of the Llama module layout, shared by every supported family -------------------------

LLAMA_PLAN = ShardingPlan({
    "self_attn.q_proj": Colwise("kv_group"),  # a group's query heads follow it
    "self_attn.k_proj": Colwise("kv_group"),
    "self_attn.v_proj": Colwise("kv_group"),
    "self_attn.o_proj": Rowwise("kv_group"),
    "mlp.gate_proj": Colwise("neuron"),
    "mlp.up_proj": Colwise("neuron"),
    "mlp.down_proj": Rowwise("neuron"),
})

# The attention of the Llama layout alone: the plan of a mixture-of-experts family, whose FFN is its routed
# experts (fused 3-D parameters, not linears; their split is `models.families.moe`'s).
ATTENTION_PLAN = ShardingPlan({m: s for m, s in LLAMA_PLAN.modules.items() if s.unit == "kv_group"})
