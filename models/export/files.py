"""What an export's directories hold and how they are read back: the shards format and file names, the
export dtype, the split rule of every checkpoint tensor, writing a directory atomically, and loading rank
shards back into a model (`models.export.writer` writes them).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from models.export.experts import CheckpointTensors
from models.families import family_for_config
from models.families.plan import SplitRule, split_dim
from models.io.digest import sha256_file
from models.io.ids import EXPORT_DTYPE_NAMES
from models.io.loading import DTYPES
from models.layouts.layout import Layout, from_json_dict

SHARDS_FORMAT = "dtp-layout-shards/1"
MANIFEST = "manifest.json"
LAYOUT_FILE = "dtp_layout.json"
# Keys by which a config names code to fetch and run (transformers' trust_remote_code): an export never
# carries a tenant's (issue 41), whatever its reader trusts. The JSON files transformers writes them to.
REMOTE_CODE_KEYS = ("auto_map", "custom_pipelines")
REMOTE_CODE_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "processor_config.json",
                     "preprocessor_config.json")


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


def split_rules(model: nn.Module) -> dict[str, SplitRule]:
    """For every tensor of the checkpoint: 'rows', 'cols' (split into L contiguous slices) or 'replicated',
    as the family's sharding plan says."""
    entries = [(n, tuple(t.shape)) for n, t in checkpoint_state(model).items()]
    return CheckpointTensors(family_for_config(model.config), entries).split_rules()


def checkpoint_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a HF checkpoint holds: the state dict without the tied lm_head."""
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def shard_file_name(rank: int) -> str:
    return f"model-rank-{rank}-part-0.safetensors"


def drop_remote_code(folder: Path) -> None:
    """Remove REMOTE_CODE_KEYS from the configs `folder` holds (each rewritten only when it had one)."""
    for name in REMOTE_CODE_FILES:
        path = folder / name
        if not path.is_file():
            continue
        config = json.loads(path.read_text())
        if isinstance(config, dict) and any(key in config for key in REMOTE_CODE_KEYS):
            for key in REMOTE_CODE_KEYS:
                config.pop(key, None)
            path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


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
    # An MoE family's per-expert checkpoint tensors go back into the model's fused expert parameters.
    entries = [(n, tuple(t.shape)) for n, t in checkpoint_state(model).items()]
    state = CheckpointTensors(family_for_config(config), entries).fused_state(state)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ExportError(f"{shards_dir}: shards do not match the config: missing {missing}, "
                          f"unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval(), layout
