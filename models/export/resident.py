"""Exporting a model in memory: the permuted copy of a model for a layout, and the checkpoint and rank shards
of a model that already realises it, through the one export (`models.export.writer.export_layout`,
permute=False)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from models.base.progress import Progress
from models.export.writer import export_layout
from models.io.sizes import UNITS
from models.layouts.layout import Layout
from models.schedules.grammar import LastScale, ScheduleSpec, schedule_spec
from models.sim.permute import permute_
from models.streaming.source import ResidentModel


def permuted_copy(model: Any, layout: Layout) -> Any:
    """A deep copy of `model` with `layout` realised as the contiguous layout."""
    return permute_(copy.deepcopy(model), layout)


def export_copy(model: Any, layout: Layout, dtype: torch.dtype | None = None) -> Any:
    """The permuted copy to export, cast to `dtype` (permuting first: the permutation is exact in any dtype)."""
    permuted = permuted_copy(model, layout)
    return permuted if dtype is None else permuted.to(dtype)


def _shard_bytes(size: str | int) -> int:
    """`max_shard_size` in bytes, as save_pretrained reads it: an int, or decimal KB/MB/GB/TB ("2GB")."""
    if isinstance(size, int):
        return size
    text = size.strip()
    return int(float(text[:-2]) * UNITS[text[-2:].upper()])


def export_checkpoint(permuted: PreTrainedModel, layout: Layout, out_dir: Path, *, tokenizer: Any = None,
                      max_shard_size: str | int = "2GB", overwrite: bool = False) -> Path:
    """The permuted model as a standard HF checkpoint, as `save_pretrained` writes it (safetensors, an index
    above max_shard_size), with the layout beside it."""
    source = ResidentModel(permuted)
    export_layout(source, layout, checkpoint_dir=Path(out_dir), shards_dir=None, dtype=source.dtype,
                  tokenizer=tokenizer, overwrite=overwrite, max_shard_bytes=_shard_bytes(max_shard_size),
                  permute=False)
    return Path(out_dir)


def export_rank_shards(permuted: PreTrainedModel, layout: Layout, out_dir: Path, *,
                       tokenizer: Any = None, overwrite: bool = False,
                       progress: Progress | None = None, compute_dtype: torch.dtype | None = None,
                       schedule: str | ScheduleSpec | None = None, last_scale: LastScale = "sqrt") -> Path:
    """Write device r's slices to `model-rank-{r}-part-0.safetensors` plus `manifest.json` (see
    `models.export.writer.export_layout`); `compute_dtype`: the dtype the model was loaded and scored in
    (None: the permuted model's)."""
    source = ResidentModel(permuted)
    export_layout(source, layout, checkpoint_dir=None, shards_dir=Path(out_dir), dtype=source.dtype,
                  tokenizer=tokenizer, overwrite=overwrite, progress=progress,
                  schedule=None if schedule is None else schedule_spec(schedule), last_scale=last_scale,
                  permute=False, compute_dtype=compute_dtype)
    return Path(out_dir)
