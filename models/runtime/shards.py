"""Reading and checking the rank shards `export` writes (`dtp-layout-shards/1`) before any compute.

Every check a rank makes before it touches its weights: the manifest's format and fields, the
layout, the config's family and shape against the layout, the manifest's split against the
family's sharding plan, the world size against L, its own file's size and sha256, and the name
and shape of every tensor in it against what the plan says a rank holds. A mismatch is a
`ShardError` naming the file and the field; nothing is half-loaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from models.base.layout_format import LayoutError
from models.base.shapes import ModelShape
from models.export.experts import CheckpointTensors
from models.export.files import MANIFEST, SHARDS_FORMAT
from models.families import Family, UnsupportedModelError, family_for_config, model_shape
from models.families.plan import PlanError, SplitRule, local_shape, stacked_bias, stacked_weight
from models.io.digest import sha256_file
from models.layouts.layout import Layout, check_fits, from_json_dict
from models.runtime.errors import ShardError
from models.schedules.grammar import ScheduleError, dtp_text, resolve_schedule


@dataclass(frozen=True)
class ShardSet:
    """A checked shard directory: what every rank agrees on before loading its own file."""

    directory: Path
    manifest: dict[str, Any]
    layout: Layout
    config: Any
    family: Family
    shape: ModelShape
    full_shapes: dict[str, tuple[int, ...]]  # every checkpoint tensor's dense shape, from the config
    rules: dict[str, SplitRule]  # the family plan's split of each tensor
    files: dict[int, dict[str, Any]]  # rank -> manifest entry
    checkpoint: CheckpointTensors  # the checkpoint's names (an MoE's experts one by one) and the model's fused ones

    @property
    def devices(self) -> int:
        return self.layout.devices

    @property
    def delta(self) -> int:
        return self.layout.delta

    @property
    def schedule(self) -> str:
        """The schedule the shards were made for: the manifest's `schedule`; shards written before it
        was recorded were made for dtp:δ with the manifest's δ."""
        recorded = self.manifest.get("schedule")
        return recorded if isinstance(recorded, str) else dtp_text(self.manifest["delta"])

    def local_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: local_shape(full, self.rules[name], self.devices) for name, full in self.full_shapes.items()}


def _fail(where: Path, msg: str) -> ShardError:
    return ShardError(f"{where}: {msg}")


def _read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not directory.is_dir():
        raise ShardError(f"{directory}: not a directory (expected the shards/ directory `export` writes)")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise _fail(path, "missing (expected the shards/ directory `export` writes, with manifest.json)") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise _fail(path, f"cannot read the shard manifest: {exc}") from exc
    if not isinstance(manifest, dict):
        raise _fail(path, "expected a JSON object")
    if manifest.get("format") != SHARDS_FORMAT:
        raise _fail(path, f"field 'format' must be {SHARDS_FORMAT!r}, got {manifest.get('format')!r}")
    for key, kind in (("devices", int), ("delta", int), ("layout", dict), ("split", dict), ("files", list)):
        if key not in manifest:
            raise _fail(path, f"missing field {key!r}")
        if not isinstance(manifest[key], kind) or isinstance(manifest[key], bool):
            raise _fail(path, f"field {key!r} must be a {kind.__name__}, got {type(manifest[key]).__name__}")
    return manifest


def _read_config(directory: Path) -> Any:
    from transformers import AutoConfig

    if not (directory / "config.json").is_file():
        raise _fail(directory / "config.json", "missing (export writes the model's config beside the shards)")
    try:
        return AutoConfig.from_pretrained(directory, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise _fail(directory / "config.json", f"cannot read the model config: {exc}") from exc


def _skeleton(config: Any) -> Any:
    """The model of `config` on the meta device: its structure without memory or weights."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def dense_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor a checkpoint of `config` holds (the tied LM head excluded)."""
    state = _skeleton(config).state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return {name: tuple(t.shape) for name, t in state.items()}


def rotary_for(config: Any, device: torch.device) -> torch.nn.Module:
    """The family's own rotary embedding (its rope scaling included), built from the config alone."""
    rotary_cls = type(_skeleton(config).model.rotary_emb)
    rotary: torch.nn.Module = rotary_cls(config=config)
    return rotary.to(device)


def _check_shape(path: Path, layout: Layout, shape: ModelShape) -> None:
    try:
        check_fits(layout, shape)
    except LayoutError as exc:
        raise _fail(path, f"the layout does not fit the model of config.json: {exc}") from exc
    for key in ("hidden_size", "head_dim"):
        mine, theirs = getattr(layout.shape, key), getattr(shape, key)
        if mine and mine != theirs:  # older layouts may leave them 0
            raise _fail(path, f"layout model.{key}={mine}, config.json gives {theirs}")


def _check_split(path: Path, split: dict[str, Any], rules: dict[str, SplitRule]) -> None:
    missing = sorted(set(rules) - set(split))
    unexpected = sorted(set(split) - set(rules))
    if missing or unexpected:
        raise _fail(path, f"field 'split' does not match the model of config.json: missing {missing[:5]}"
                          f"{' …' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                          f"{' …' if len(unexpected) > 5 else ''}")
    for name, rule in rules.items():
        if split[name] != rule:
            raise _fail(path, f"split[{name!r}] is {split[name]!r}, but the family's sharding plan says {rule!r}")


def _check_schedule(path: Path, manifest: dict[str, Any], num_layers: int, devices: int) -> None:
    """The manifest's `schedule` (optional: older shards are dtp:δ) must be one this model can run."""
    if "schedule" not in manifest:
        return
    schedule = manifest["schedule"]
    if not isinstance(schedule, str):
        raise _fail(path, f"field 'schedule' must be a string, got {type(schedule).__name__}")
    try:
        resolved = resolve_schedule(schedule, num_layers, devices)
    except ScheduleError as exc:
        raise _fail(path, f"field 'schedule': {exc}") from exc
    if resolved.name != schedule:
        raise _fail(path, f"field 'schedule' is {schedule!r}; its canonical form is {resolved.name!r}")


def _check_files(path: Path, files: list[Any], devices: int) -> dict[int, dict[str, Any]]:
    by_rank: dict[int, dict[str, Any]] = {}
    for i, entry in enumerate(files):
        if not isinstance(entry, dict):
            raise _fail(path, f"files[{i}] must be an object")
        for key, kind in (("name", str), ("rank", int), ("size", int), ("sha256", str)):
            if not isinstance(entry.get(key), kind) or isinstance(entry.get(key), bool):
                raise _fail(path, f"files[{i}].{key} must be a {kind.__name__}, got {entry.get(key)!r}")
        name = entry["name"]
        if os.path.basename(name) != name or name in ("", ".", "..") or not name.endswith(".safetensors"):
            raise _fail(path, f"files[{i}].name must be a plain .safetensors file name, got {name!r}")
        if entry["rank"] in by_rank:
            raise _fail(path, f"files[{i}]: rank {entry['rank']} is listed twice")
        by_rank[entry["rank"]] = entry
    if sorted(by_rank) != list(range(devices)):
        raise _fail(path, f"field 'files' must list ranks 0..{devices - 1} once each, got {sorted(by_rank)}")
    return by_rank


def read_shard_set(shards_dir: str | Path) -> ShardSet:
    """Read and cross-check manifest.json and config.json (no weights are read)."""
    directory = Path(shards_dir)
    manifest = _read_manifest(directory)
    path = directory / MANIFEST
    try:
        layout = from_json_dict(manifest["layout"], source=f"{path} field 'layout'")
    except LayoutError as exc:
        raise ShardError(str(exc)) from exc
    if manifest["devices"] != layout.devices:
        raise _fail(path, f"field 'devices' is {manifest['devices']} but the layout has devices={layout.devices}")
    if manifest["delta"] != layout.delta:
        raise _fail(path, f"field 'delta' is {manifest['delta']} but the layout has delta={layout.delta}")
    config = _read_config(directory)
    try:
        family = family_for_config(config)
    except UnsupportedModelError as exc:
        raise _fail(directory / "config.json", str(exc)) from exc
    shape = model_shape(config)
    _check_shape(path, layout, shape)
    checkpoint = CheckpointTensors(family, dense_shapes(config).items())  # an MoE's experts one by one
    full = dict(checkpoint.entries)
    try:
        rules = checkpoint.split_rules()
    except PlanError as exc:
        raise _fail(directory / "config.json", str(exc)) from exc
    _check_split(path, manifest["split"], rules)
    files = _check_files(path, manifest["files"], layout.devices)
    _check_schedule(path, manifest, shape.num_layers, layout.devices)
    return ShardSet(directory, manifest, layout, config, family, shape, full, rules, files, checkpoint)


def check_world_size(shards: ShardSet, world_size: int) -> None:
    if world_size != shards.devices:
        raise ShardError(
            f"{shards.directory / MANIFEST}: world size {world_size} does not equal the layout's "
            f"L={shards.devices} (field 'devices'): run the shards with exactly {shards.devices} ranks")


def load_rank_tensors(shards: ShardSet, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors, after checking the file's size, sha256, tensor names, shapes and dtypes."""
    entry = shards.files[rank]
    path = shards.directory / entry["name"]
    if not path.is_file():
        raise _fail(path, f"missing (rank {rank}'s shard, listed in {MANIFEST})")
    size = path.stat().st_size
    if size != entry["size"]:
        raise _fail(path, f"size {size} bytes does not match the manifest's {entry['size']} (truncated or replaced?)")
    if sha256_file(path) != entry["sha256"]:
        raise _fail(path, f"sha256 does not match the manifest (corrupted or replaced): expected {entry['sha256']}")
    expected = shards.local_shapes()
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in names}
            dtypes = {f.get_slice(name).get_dtype() for name in names}
    except Exception as exc:  # safetensors raises its own error types for a malformed header
        raise _fail(path, f"not a readable safetensors file: {exc}") from exc
    missing, unexpected = sorted(set(expected) - names), sorted(names - set(expected))
    if missing or unexpected:
        raise _fail(path, f"tensors do not match the model of config.json: missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}")
    for name, want in expected.items():
        if shapes[name] != want:
            raise _fail(path, f"tensor {name!r} has shape {list(shapes[name])}, rank {rank} of L={shards.devices} "
                              f"should hold {list(want)} ({shards.rules[name]} of {list(shards.full_shapes[name])})")
    if len(dtypes) != 1 or next(iter(dtypes)) not in ("F32", "F16", "BF16"):
        raise _fail(path, f"tensors must share one float dtype (F32, F16, BF16), found {sorted(dtypes)}")
    return {name: t.to(device) for name, t in load_file(str(path)).items()}


class RankWeights:
    """One rank's weights as the module math wants them (`models.sim.partials.StackedWeights`, P = 1)."""

    parts = 1

    def __init__(self, tensors: dict[str, torch.Tensor], family: Family, num_layers: int,
                 prefix: str = "model.layers.") -> None:
        plan = family.plan
        self.linears: list[dict[str, tuple[torch.Tensor, torch.Tensor | None]]] = []
        self.tensors: list[dict[str, torch.Tensor]] = []
        for i in range(num_layers):
            base = f"{prefix}{i}."
            linears = {}
            for module, style in plan.modules.items():
                weight = tensors[f"{base}{module}.weight"]
                bias = tensors.get(f"{base}{module}.bias")
                linears[module] = (stacked_weight(weight, style, 1), None if bias is None else stacked_bias(bias, 1))
            self.linears.append(linears)
            self.tensors.append({name[len(base):]: t for name, t in tensors.items() if name.startswith(base)})

    def linear(self, layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.linears[layer][module]

    def tensor(self, layer: int, name: str) -> torch.Tensor:
        return self.tensors[layer][name]
