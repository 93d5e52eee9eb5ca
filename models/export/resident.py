"""Sharded export: the permuted Hugging Face checkpoint and per-rank DTP shards.

Everything is written under a temporary name and renamed into place when complete, so a crash
never leaves a half-written checkpoint where a reader expects a whole one.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from models.families import family_for_config, model_shape
from models.families.plan import SplitRule, rank_slice, split_dim
from models.io.digest import sha256_file
from models.io.ids import EXPORT_DTYPE_NAMES
from models.io.loading import DTYPES
from models.layouts.layout import Layout, check_fits, from_json_dict
from models.run.progress import Progress
from models.schedules.grammar import LastScale, resolve_schedule
from models.serving.manifest import serving_fields, write_serving_config
from models.sim.permute import permute_

SHARDS_FORMAT = "dtp-layout-shards/1"
MANIFEST = "manifest.json"
LAYOUT_FILE = "dtp_layout.json"


class ExportError(RuntimeError):
    pass


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def source_dtype(config: Any) -> torch.dtype | None:
    """The dtype the source checkpoint stores (its config.json), read before loading; None when it says
    none or a non-float one (a GGUF file is quantised: its dequantised weights have no dtype of their own)."""
    # `dtype` (transformers ≥ 4.56); a config object of an older one keeps `torch_dtype` as a plain attribute.
    # Never `config.torch_dtype` itself: on transformers 5 it is a property that logs "`torch_dtype` is deprecated"
    # (what `optimise` of a GGUF, whose config has no dtype, printed).
    value = getattr(config, "dtype", None) or vars(config).get("torch_dtype")
    name = dtype_name(value) if isinstance(value, torch.dtype) else str(value) if value else None
    return DTYPES.get(name) if name else None


def export_dtype(requested: str, *, config: Any, compute: torch.dtype) -> torch.dtype:
    """What exported weights are stored in: `requested`, or for `auto` the source checkpoint's dtype
    (a bf16 hub model exports bf16 whatever the passes computed in), else the compute dtype."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ExportError(f"export dtype must be one of {', '.join(EXPORT_DTYPE_NAMES)}, got {requested!r}")
        return DTYPES[requested]
    return source_dtype(config) or compute


def export_copy(model: Any, layout: Layout, dtype: torch.dtype | None = None) -> Any:
    """The permuted copy to export, cast to `dtype` (permuting first: the permutation is exact in any dtype)."""
    permuted = permuted_copy(model, layout)
    return permuted if dtype is None else permuted.to(dtype)


@contextmanager
def atomic_dir(target: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory that replaces `target` only if the block succeeds."""
    target = Path(target)
    if target.exists() and not overwrite:
        raise ExportError(f"{target} already exists (pass overwrite=True / --overwrite to replace it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.partial-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        target.rename(old)
    tmp.rename(target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def permuted_copy(model: Any, layout: Layout) -> Any:
    """A deep copy of `model` with `layout` realised as the contiguous layout."""
    return permute_(copy.deepcopy(model), layout)


def _write_layout(path: Path, layout: Layout) -> None:
    path.write_text(json.dumps(layout.to_json_dict()))


def export_checkpoint(permuted: PreTrainedModel, layout: Layout, out_dir: Path, *, tokenizer: Any = None,
                      max_shard_size: str | int = "2GB", overwrite: bool = False) -> Path:
    """Save the permuted model as a standard HF checkpoint (safetensors, index above max_shard_size)."""
    with atomic_dir(Path(out_dir), overwrite) as tmp:
        permuted.save_pretrained(tmp, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _write_layout(tmp / LAYOUT_FILE, layout)
    return Path(out_dir)


# ---- per-rank shards ---------------------------------------------------------------------------

def split_rules(model: nn.Module) -> dict[str, SplitRule]:
    """For every tensor of the checkpoint: 'rows', 'cols' (split into L contiguous slices) or 'replicated',
    as the family's sharding plan says."""
    return family_for_config(model.config).plan.split_rules(checkpoint_state(model))


def checkpoint_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a HF checkpoint holds: the state dict without the tied lm_head."""
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def shard_file_name(rank: int) -> str:
    return f"model-rank-{rank}-part-0.safetensors"


def export_rank_shards(permuted: PreTrainedModel, layout: Layout, out_dir: Path, *,
                       tokenizer: Any = None, overwrite: bool = False,
                       progress: Progress | None = None, compute_dtype: torch.dtype | None = None,
                       schedule: str | None = None, last_scale: LastScale = "sqrt") -> Path:
    """Write device r's slices to `model-rank-{r}-part-0.safetensors` plus `manifest.json`.

    `schedule`: the communication schedule the shards are made for (`models.schedules.grammar`; the runtime
    refuses to run them at another), recorded canonical; None: the layout's dtp:δ. The manifest's `serving`
    records its per-module table (with `last_scale`), the family, L and the layout's provenance, and
    config.json names the family's DTP architecture (`models.serving.manifest`).

    The manifest's `dtype` is the shards' (what a reader loads); `compute_dtype` the dtype the model
    was loaded and scored in, when it was given and differs or not."""
    shape = model_shape(permuted.config)
    check_fits(layout, shape)
    table = resolve_schedule(schedule or f"dtp:{layout.delta}", shape.num_layers, layout.devices, last_scale)
    made_for = table.name
    family = family_for_config(permuted.config)
    rules = split_rules(permuted)
    serving = serving_fields(shape.model_type, family.name, layout, table)
    state = checkpoint_state(permuted)
    devices = layout.devices
    with atomic_dir(Path(out_dir), overwrite) as tmp:
        files = []
        for rank in range(devices):
            tensors = {name: rank_slice(t, rules[name], rank, devices).detach().cpu().contiguous()
                       for name, t in state.items()}
            name = shard_file_name(rank)
            save_file(tensors, str(tmp / name), metadata={"format": "pt", "rank": str(rank)})
            files.append({"name": name, "rank": rank, "size": (tmp / name).stat().st_size,
                          "sha256": sha256_file(tmp / name)})
            if progress:
                progress("shards", (rank + 1) / devices)
        permuted.config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        manifest = {
            "format": SHARDS_FORMAT,
            "devices": devices,
            "delta": layout.delta,
            "layout": layout.to_json_dict(),
            # Additive to dtp-layout-shards/1: the schedule the shards are made for (absent: dtp:δ).
            "schedule": made_for,
            "split": rules,
            # Additive to dtp-layout-shards/1 (readers must not require them): the family's plan and dtype.
            "plan": family.plan.to_json_dict(),
            "dtype": dtype_name(next(iter(state.values())).dtype),
            "compute_dtype": dtype_name(compute_dtype or next(iter(state.values())).dtype),
            "files": files,
            # Additive: what a server (vLLM through models.serving.vllm) needs; config.json names the DTP model.
            "serving": serving,
        }
        write_serving_config(tmp, serving)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return Path(out_dir)


def read_manifest(shards_dir: Path) -> dict[str, Any]:
    path = Path(shards_dir) / MANIFEST
    try:
        manifest: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ExportError(f"{path}: cannot read shard manifest: {exc}") from exc
    if manifest.get("format") != SHARDS_FORMAT:
        raise ExportError(f"{path}: format must be {SHARDS_FORMAT!r}, got {manifest.get('format')!r}")
    return manifest


def load_rank_shards(shards_dir: Path, *, verify: bool = True) -> tuple[PreTrainedModel, Layout]:
    """Rebuild the permuted model from its rank shards (concatenating slices in rank order)."""
    shards_dir = Path(shards_dir)
    manifest = read_manifest(shards_dir)
    layout = from_json_dict(manifest["layout"], source=str(shards_dir / MANIFEST))
    files = sorted(manifest["files"], key=lambda f: f["rank"])
    if [f["rank"] for f in files] != list(range(manifest["devices"])):
        raise ExportError(f"{shards_dir}: manifest must list ranks 0..{manifest['devices'] - 1}")
    parts = []
    for entry in files:
        path = shards_dir / os.path.basename(entry["name"])
        if verify and sha256_file(path) != entry["sha256"]:
            raise ExportError(f"{path}: sha256 does not match the manifest")
        parts.append(load_file(str(path)))
    state = {}
    for name, rule in manifest["split"].items():
        slices = [p[name] for p in parts]
        dim = split_dim(rule)
        state[name] = slices[0] if dim is None else torch.cat(slices, dim=dim)
    config = AutoConfig.from_pretrained(shards_dir, trust_remote_code=False)
    model = AutoModelForCausalLM.from_config(config, dtype=next(iter(state.values())).dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ExportError(f"{shards_dir}: shards do not match the config: missing {missing}, "
                          f"unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval(), layout
