"""Layouts: which device holds each KV group and each FFN neuron, per layer.

A layout is balanced (G/L groups and I/L neurons on every device) and serialises to the
`dtp-layout/1` JSON format (`models.base.layout_format`) described in docs/formats.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from models.base.layout_format import LAYOUT_FORMAT, LayoutError
from models.base.shapes import ModelShape
from models.io.atomic import atomic_write_json
from models.layouts.names import CONTIGUOUS, random_name
from models.schedules.grammar import MAX_SCHEDULE_CHARS


def valid_device_counts(shape: ModelShape) -> list[int]:
    """The L dividing both G and I (an MoE model: each expert's I_e): the divisors of their gcd, found in
    O(√gcd) (a config is input)."""
    n = math.gcd(shape.num_kv_groups, shape.block_size)
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _is_int(x: object) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def check_devices(shape: ModelShape, devices: int) -> None:
    """Raise LayoutError unless `devices` divides both the KV groups and the FFN width."""
    if not _is_int(devices) or devices < 1:
        raise LayoutError(f"devices must be a positive integer, got {devices!r}")
    bad = []
    if shape.num_kv_groups % devices:
        bad.append(f"num_kv_groups={shape.num_kv_groups}")
    width = "expert_size" if shape.num_experts else "intermediate_size"  # an MoE model splits every expert
    if shape.block_size % devices:
        bad.append(f"{width}={shape.block_size}")
    if bad:
        valid = ", ".join(map(str, valid_device_counts(shape)))
        raise LayoutError(
            f"devices L={devices} does not divide {' and '.join(bad)}; "
            f"L must divide both num_kv_groups and {width}: valid L for this model: {valid}"
        )


def check_delta(shape: ModelShape, delta: int) -> None:
    if not _is_int(delta) or not 0 <= delta <= shape.num_layers:
        raise LayoutError(
            f"delta must be an integer in [0, num_layers={shape.num_layers}] (modules are counted two "
            f"per layer), got {delta!r}"
        )


@dataclass(frozen=True, eq=False)
class Layout:
    """kv_group_device: [N, G] int; neuron_device: [N, I] int; both read-only."""

    name: str
    devices: int
    delta: int
    shape: ModelShape
    kv_group_device: np.ndarray
    neuron_device: np.ndarray
    score: dict[str, Any] | None = field(default=None)
    # The communication schedule the layout was optimised for (issue 20), its canonical string; None: not
    # recorded (files from before schedules, and dtp:1 runs through the chain objective): dtp:1.
    schedule: str | None = field(default=None)

    def __post_init__(self) -> None:
        for attr in ("kv_group_device", "neuron_device"):
            arr = np.array(getattr(self, attr), dtype=np.int64)
            arr.setflags(write=False)
            object.__setattr__(self, attr, arr)
        validate(self)

    def group_order(self, layer: int) -> np.ndarray:
        """Storage order that puts device 0's KV groups first (stable within a device)."""
        return np.argsort(self.kv_group_device[layer], kind="stable")

    def neuron_order(self, layer: int) -> np.ndarray:
        """Storage order that puts device 0's neurons first (stable within a device); an MoE model's within
        each expert (issue 46): expert e's device-l neurons at positions e·I_e + [l·I_e/L, (l+1)·I_e/L)."""
        blocks = self.neuron_device[layer].reshape(self.shape.neuron_blocks, -1)  # [E or 1, I_e or I]
        offsets = np.arange(blocks.shape[0])[:, None] * blocks.shape[1]
        return (np.argsort(blocks, axis=1, kind="stable") + offsets).reshape(-1)

    def with_name(self, name: str, score: dict[str, Any] | None = None) -> Layout:
        return Layout(name, self.devices, self.delta, self.shape, self.kv_group_device,
                      self.neuron_device, score if score is not None else self.score, self.schedule)

    @property
    def made_for(self) -> str:
        """The schedule the layout was made for: its recorded one, else dtp:1 (the chain objective)."""
        return self.schedule if self.schedule is not None else "dtp:1"

    def to_json_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": LAYOUT_FORMAT,
            "name": self.name,
            "devices": self.devices,
            "delta": self.delta,
            "model": shape_json(self.shape),
            "kv_group_device": self.kv_group_device.tolist(),
            "neuron_device": self.neuron_device.tolist(),
        }
        if self.schedule is not None:
            out["schedule"] = self.schedule
        if self.score is not None:
            out["score"] = self.score
        return out

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_json_dict(), indent=None)


def shape_json(shape: ModelShape) -> dict[str, Any]:
    """A layout file's `model`: the shape's fields, the MoE ones only for an MoE model (a dense layout's file
    is what it was before issue 46)."""
    out = asdict(shape)
    if not shape.num_experts:
        for key in _MOE_FIELDS:
            out.pop(key)
    return out


def _check_assignment(arr: np.ndarray, field_name: str, width: int, devices: int, layers: int,
                      blocks: int = 1) -> None:
    """Shape, device ids and balance: every one of `blocks` equal blocks of a row (an MoE layer's experts)
    holds width/(blocks·L) units on each device."""
    if arr.ndim != 2 or arr.shape != (layers, width):
        raise LayoutError(f"{field_name}: expected shape [{layers}, {width}], got {list(arr.shape)}")
    size = width // blocks
    per_device = size // devices
    for layer in range(layers):
        row = arr[layer]
        if row.min() < 0 or row.max() >= devices:
            raise LayoutError(
                f"{field_name}[{layer}]: device ids must be in [0, {devices - 1}], "
                f"found {int(row.min())}..{int(row.max())}"
            )
        for block in range(blocks):
            counts = np.bincount(row[block * size : (block + 1) * size], minlength=devices)
            if (counts != per_device).any():
                which = f" expert {block}" if blocks > 1 else ""
                raise LayoutError(
                    f"{field_name}[{layer}]:{which} unbalanced, per-device counts {counts.tolist()}, "
                    f"expected {per_device} on each of {devices} devices"
                    + (f" (an MoE layout puts {per_device} of each expert's {size} neurons on every device)"
                       if blocks > 1 else "")
                )


def validate(layout: Layout) -> None:
    shape = layout.shape
    check_devices(shape, layout.devices)
    check_delta(shape, layout.delta)
    _check_assignment(layout.kv_group_device, "kv_group_device", shape.num_kv_groups,
                      layout.devices, shape.num_layers)
    _check_assignment(layout.neuron_device, "neuron_device", shape.intermediate_size,
                      layout.devices, shape.num_layers, shape.neuron_blocks)


def _contiguous_row(width: int, devices: int, blocks: int = 1) -> np.ndarray:
    """Each of `blocks` equal blocks (an MoE layer's experts) sliced into L contiguous shards: [width]."""
    return np.tile(np.repeat(np.arange(devices), width // blocks // devices), blocks)


def contiguous(shape: ModelShape, devices: int, delta: int = 1, name: str = CONTIGUOUS) -> Layout:
    """The standard tensor-parallel layout: storage order sliced into L contiguous shards."""
    check_devices(shape, devices)
    n = shape.num_layers
    groups = np.tile(_contiguous_row(shape.num_kv_groups, devices), (n, 1))
    neurons = np.tile(_contiguous_row(shape.intermediate_size, devices, shape.neuron_blocks), (n, 1))
    return Layout(name, devices, delta, shape, groups, neurons)


def random(shape: ModelShape, devices: int, delta: int = 1, seed: int = 0,
           name: str | None = None) -> Layout:
    """Uniform among balanced layouts: a uniform shuffle of the contiguous assignment, per layer (an MoE
    model's: of each expert's, every expert balanced)."""
    check_devices(shape, devices)
    rng = np.random.default_rng(seed)
    g_row = _contiguous_row(shape.num_kv_groups, devices)
    i_row = _contiguous_row(shape.block_size, devices)  # one block: the dense FFN, or one expert
    groups = np.stack([rng.permutation(g_row) for _ in range(shape.num_layers)])
    neurons = np.stack([np.concatenate([rng.permutation(i_row) for _ in range(shape.neuron_blocks)])
                        for _ in range(shape.num_layers)])
    return Layout(name or random_name(seed), devices, delta, shape, groups, neurons)


_SHAPE_FIELDS = ("model_type", "num_layers", "num_kv_groups", "num_query_heads", "intermediate_size")
_MOE_FIELDS = ("num_experts", "experts_per_token", "expert_size")


def from_json_dict(data: Any, source: str = "layout") -> Layout:
    def fail(msg: str) -> LayoutError:
        return LayoutError(f"{source}: {msg}")

    if not isinstance(data, dict):
        raise fail("expected a JSON object")
    if data.get("format") != LAYOUT_FORMAT:
        raise fail(f"field 'format' must be {LAYOUT_FORMAT!r}, got {data.get('format')!r}")
    for key in ("devices", "delta", "model", "kv_group_device", "neuron_device"):
        if key not in data:
            raise fail(f"missing field {key!r}")
    model = data["model"]
    if not isinstance(model, dict):
        raise fail("field 'model' must be an object")
    for key in _SHAPE_FIELDS:
        if key not in model:
            raise fail(f"missing field 'model.{key}'")
    if not isinstance(model["model_type"], str):
        raise fail("field 'model.model_type' must be a string")
    for key in ModelShape.__dataclass_fields__:
        if key != "model_type" and key in model and (not _is_int(model[key]) or model[key] < 0):
            raise fail(f"field 'model.{key}' must be a non-negative integer, got {model[key]!r}")
    for key in ("devices", "delta"):
        if not _is_int(data[key]):
            raise fail(f"field {key!r} must be an integer, got {data[key]!r}")
    shape = ModelShape(**{k: model[k] for k in ModelShape.__dataclass_fields__ if k in model})
    if shape.num_experts and shape.intermediate_size != shape.num_experts * shape.expert_size:
        raise fail(f"field 'model.intermediate_size' must be num_experts × expert_size = "
                   f"{shape.num_experts} × {shape.expert_size} for an MoE model (its units are the experts' "
                   f"neurons), got {shape.intermediate_size}")
    schedule = data.get("schedule")
    if schedule is not None and (not isinstance(schedule, str) or not 0 < len(schedule) <= MAX_SCHEDULE_CHARS):
        raise fail(f"field 'schedule' must be a schedule string of 1..{MAX_SCHEDULE_CHARS} characters, "
                   f"got {str(schedule)[:40]!r}")
    groups = _int_array(data["kv_group_device"], "kv_group_device", fail)
    neurons = _int_array(data["neuron_device"], "neuron_device", fail)
    try:
        return Layout(str(data.get("name", "layout")), data["devices"], data["delta"], shape,
                      groups, neurons, data.get("score"), schedule)
    except LayoutError as exc:
        raise fail(str(exc)) from exc


def _int_array(value: Any, field_name: str, fail: Any) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise fail(f"{field_name}: must be equal-length integer lists, one per layer: {exc}") from exc
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise fail(f"{field_name}: device ids must be integers (one equal-length list per layer), got {arr.dtype}")
    return arr.astype(np.int64)


def load(path: str | Path) -> Layout:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LayoutError(f"{path}: cannot read layout JSON: {exc}") from exc
    return from_json_dict(data, source=str(path))


def check_fits(layout: Layout, shape: ModelShape) -> None:
    """Raise unless the layout was made for a model of this shape."""
    for key in (*_SHAPE_FIELDS, "num_experts", "expert_size"):
        mine, theirs = getattr(layout.shape, key), getattr(shape, key)
        if mine != theirs:
            raise LayoutError(f"layout {layout.name!r} is for model.{key}={mine}, the model has {theirs}")

