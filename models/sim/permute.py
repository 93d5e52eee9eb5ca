"""Function-preserving permutation: realise a layout by reordering weights.

Per layer, KV groups are reordered (each carrying its query heads): rows of q/k/v (and their
biases) and columns of o_proj; FFN neurons are reordered: rows of gate/up and columns of down.
Which weights move, and along which dimension, is the family's sharding plan.
Units are sorted by device, stably, so device l's shard becomes the l-th contiguous slice, which
is what any standard tensor-parallel loader takes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from models.base.shapes import ModelShape
from models.families import Family, family_for_config, model_shape
from models.layouts.layout import Layout, check_fits
from models.sim.moe import expert_orders, reorder_experts_


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = model.model.layers  # type: ignore[union-attr]
    assert isinstance(layers, nn.ModuleList)
    return layers


def _get(layer: nn.Module, dotted: str) -> nn.Linear:
    mod = layer.get_submodule(dotted)
    assert isinstance(mod, nn.Linear), dotted
    return mod


def group_row_index(group_order: np.ndarray, rows_per_group: int) -> torch.Tensor:
    """Row indices that move whole groups of `rows_per_group` consecutive rows."""
    g = torch.as_tensor(np.asarray(group_order), dtype=torch.long)  # [G]
    return (g[:, None] * rows_per_group + torch.arange(rows_per_group)).reshape(-1)  # [G * rows]


def _take_(param: torch.Tensor, index: torch.Tensor, dim: int) -> None:
    param.data = param.data.index_select(dim, index.to(param.device)).contiguous()


@torch.no_grad()
def reorder_(model: nn.Module, family: Family, shape: ModelShape,
             group_orders: Sequence[np.ndarray], neuron_orders: Sequence[np.ndarray]) -> None:
    """Put group `group_orders[i][p]` at position p of layer i (and likewise neurons), in place.

    What moves is the family's sharding plan: each planned linear's split dimension holds one
    contiguous block per unit (a KV group's block of q rows is its query heads), so the block size
    is the dimension's size over the number of units.
    """
    for i, layer in enumerate(decoder_layers(model)):
        reorder_layer_(layer, family, shape, group_orders[i], neuron_orders[i])


@torch.no_grad()
def reorder_layer_(layer: nn.Module, family: Family, shape: ModelShape, group_order: np.ndarray,
                   neuron_order: np.ndarray) -> None:
    """One decoder layer of `reorder_` (a streamed pass permutes each layer as it is read)."""
    units = {"kv_group": shape.num_kv_groups, "neuron": shape.intermediate_size}
    orders = {"kv_group": group_order, "neuron": neuron_order}
    for name, style in family.plan.modules.items():
        lin = _get(layer, name)
        size = lin.weight.shape[style.dim]
        index = group_row_index(orders[style.unit], size // units[style.unit])  # [size]
        _take_(lin.weight, index, style.dim)
        if lin.bias is not None and style.dim == 0:
            _take_(lin.bias, index, 0)
    if shape.num_experts:  # an MoE FFN: each expert's neurons move within it (models.sim.moe)
        reorder_experts_(layer, expert_orders(neuron_order, shape.num_experts, shape.expert_size))


def permuted_tensor(name: str, tensor: torch.Tensor, family: Family, shape: ModelShape,
                    layout: Layout) -> torch.Tensor:
    """One checkpoint tensor as `permute_` leaves it (the same index_select: bit-identical), for a pass that
    never holds the model (models.export.writer). Tensors the plan does not name come back unchanged."""
    planned = family.plan.planned(name)
    if planned is None:
        return tensor
    layer, _module, style, kind = planned
    if kind == "bias" and style.dim != 0:
        return tensor
    dim = style.dim if kind == "weight" else 0
    units = {"kv_group": shape.num_kv_groups, "neuron": shape.intermediate_size}[style.unit]
    order = layout.group_order(layer) if style.unit == "kv_group" else layout.neuron_order(layer)
    index = group_row_index(order, tensor.shape[dim] // units)  # [size]
    return tensor.index_select(dim, index.to(tensor.device)).contiguous()


def permute_(model: nn.Module, layout: Layout) -> nn.Module:
    """Permute `model` in place so that `layout` becomes the contiguous layout. Returns the model."""
    family = family_for_config(model.config)
    shape = model_shape(model.config)
    check_fits(layout, shape)
    n = shape.num_layers
    reorder_(model, family, shape, [layout.group_order(i) for i in range(n)],
             [layout.neuron_order(i) for i in range(n)])
    return model


def unpermute_(model: nn.Module, layout: Layout) -> nn.Module:
    """Undo `permute_(model, layout)`: apply the inverse orders."""
    family = family_for_config(model.config)
    shape = model_shape(model.config)
    check_fits(layout, shape)
    n = shape.num_layers
    reorder_(model, family, shape, [np.argsort(layout.group_order(i)) for i in range(n)],
             [np.argsort(layout.neuron_order(i)) for i in range(n)])
    return model
