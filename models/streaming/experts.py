"""A streamed MoE layer's parameters from its checkpoint (issue 46): the loaded model holds a layer's experts
fused (`models.families.moe`: `mlp.experts.gate_up_proj` [E, 2·I_e, D], `mlp.experts.down_proj` [E, D, I_e],
the router `mlp.gate.weight`), while a checkpoint directory holds them one expert at a time under the family's
own names (`Family.moe.checkpoint`), as `save_pretrained` writes them. A parameter the checkpoint holds as is
(a dense family's, or a checkpoint saved fused) is read as is; a fused expert parameter is stacked from its
experts' tensors, as transformers' loader does, so the materialised layer equals the in-memory model's.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from models.families.moe import DOWN, GATE_UP, ROUTER, MoeFfn
from models.io.loading import ModelLoadError

_LAYER = re.compile(r"^(?P<prefix>.*\.layers\.\d+)\.(?P<rel>.+)$")


def _stored_names(name: str, moe: MoeFfn | None, experts: int) -> list[str] | None:
    """The checkpoint tensors parameter `name` is made of, in order; None: not an expert parameter."""
    match = _LAYER.match(name)
    if moe is None or match is None or match["rel"] not in (ROUTER, GATE_UP, DOWN):
        return None
    prefix, rel, names = match["prefix"], match["rel"], moe.checkpoint
    if rel == ROUTER:
        return [f"{prefix}.{names.router}"]
    roles = ("gate", "up") if rel == GATE_UP else ("down",)
    return [f"{prefix}.{getattr(names, role).format(e=e)}" for role in roles for e in range(experts)]


def read_parameters(reader: Any, names: list[str], family: Any, config: Any) -> dict[str, torch.Tensor]:
    """The named parameters of the loaded model as stored in `reader`'s checkpoint (its dtype): each as is when
    the checkpoint holds it, an MoE family's fused expert parameter stacked from its per-expert tensors."""
    moe = getattr(family, "moe", None)
    experts = moe.num_experts(config) if moe is not None else 0
    parts = {n: None if n in reader.tensors else _stored_names(n, moe, experts) for n in names}
    missing = [n for n, p in parts.items() if p is None and n not in reader.tensors]
    if missing:
        raise ModelLoadError(f"{reader.directory}: the checkpoint has no tensor {missing[0]!r}")
    wanted = [n for n, p in parts.items() if p is None] + [s for p in parts.values() if p is not None for s in p]
    stored = reader.read(wanted)
    out: dict[str, torch.Tensor] = {}
    for name, pieces in parts.items():
        if pieces is None:
            out[name] = stored[name]
        elif name.endswith(ROUTER):
            out[name] = stored[pieces[0]]
        elif name.endswith(GATE_UP):  # [E, I_e, D] gates then [E, I_e, D] ups -> [E, 2·I_e, D]
            gates = torch.stack([stored[p] for p in pieces[:experts]])
            ups = torch.stack([stored[p] for p in pieces[experts:]])
            out[name] = torch.cat([gates, ups], dim=1)
        else:  # down: [E, D, I_e]
            out[name] = torch.stack([stored[p] for p in pieces])
    return out
