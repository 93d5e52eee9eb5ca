"""The export, written once: a layout's permuted Hugging Face checkpoint and its per-rank shards with their
manifest, tensor by tensor from any `models.streaming.source.LayerSource` (a loaded model's own tensors, or
a `StreamedModel`'s read from its safetensors); the sources differ only in where a tensor comes from.

Each checkpoint tensor is taken in the compute dtype (`LayerSource.checkpoint_tensor`: as loading casts it),
permuted (`models.sim.permute.permuted_tensor`, the same index_select as `permute_`), cast to the export
dtype, written to its checkpoint file and its slice to each rank's shard file
(`models.streaming.safetensors_reader.SafetensorsWriter`: headers first, from the shapes alone; the bytes
`save_file` writes), then dropped: peak memory a few copies of the largest tensor. The checkpoint is what
`save_pretrained(max_shard_size=…)` writes: its files split as huggingface_hub splits a state dict
(`model-0000K-of-0000N.safetensors` and `model.safetensors.index.json`, or one `model.safetensors`),
config.json and generation_config.json (`LayerSource.save_configs`). The shards directory is
`dtp-layout-shards/1` (one file per rank, config.json naming the DTP architecture, manifest.json).

Everything is written under a temporary name and renamed into place when complete, so a crash never
leaves a half-written checkpoint where a reader expects a whole one.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from models.base.progress import Progress, check_stop
from models.export.experts import CheckpointTensors
from models.export.files import (
    LAYOUT_FILE,
    MANIFEST,
    SHARDS_FORMAT,
    atomic_dir,
    drop_remote_code,
    dtype_name,
    shard_file_name,
)
from models.export.serving_manifest import serving_fields, write_serving_config
from models.families import family_for_config, model_shape
from models.families.plan import local_shape, rank_slice
from models.io.digest import sha256_file
from models.layouts.layout import Layout, check_fits
from models.schedules.grammar import LastScale, ScheduleSpec, dtp_spec
from models.sim.permute import permuted_tensor
from models.streaming.layer_source import return_freed_memory
from models.streaming.safetensors_reader import SafetensorsWriter
from models.streaming.source import LayerSource

SAFE_INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 * 10**9  # export_checkpoint's max_shard_size, "2GB"


def _file_groups(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """The tensors (by index) of each checkpoint file, as huggingface_hub's `split_torch_state_dict_into_shards`
    groups them for `save_pretrained`: in order, a file closed when the next tensor would take it over
    `max_bytes`; a tensor larger than that in a file of its own, listed when it is met."""
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for k, size in enumerate(sizes):
        if size > max_bytes:
            groups.append([k])
            continue
        if total + size > max_bytes:
            groups.append(current)
            current, total = [], 0
        current.append(k)
        total += size
    if current:
        groups.append(current)
    return groups


def checkpoint_files(sizes: list[int], max_bytes: int) -> dict[int, str]:
    """Each tensor's checkpoint file name (by index), as save_pretrained names them."""
    groups = _file_groups(sizes, max_bytes)
    names = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors" for g in range(len(groups))]
    return {k: names[g] for g, members in enumerate(groups) for k in members}


def export_layout(source: LayerSource, layout: Layout, *, checkpoint_dir: Path | None, shards_dir: Path | None,
                  dtype: torch.dtype, tokenizer: Any = None, overwrite: bool = False,
                  progress: Progress | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                  schedule: ScheduleSpec | None = None, last_scale: LastScale = "sqrt", permute: bool = True,
                  compute_dtype: torch.dtype | None = None) -> None:
    """`checkpoint_dir` (the permuted checkpoint) and/or `shards_dir` (the rank shards) for `layout`, from `source`.

    `schedule`: the communication schedule the shards are made for (`models.schedules.grammar`; the runtime
    refuses to run them at another), recorded canonical; None: dtp:δ of the layout's δ. The manifest's `serving`
    records its per-module table (with `last_scale`), the family, L and the layout's provenance, and
    config.json names the family's DTP architecture (`models.export.serving_manifest`). The manifest's `dtype` is the
    shards' (`dtype`: what a reader loads), `compute_dtype` the dtype the model was loaded and scored in (None:
    the source's). permute False: the source's weights realise `layout` already.
    """
    config = source.config
    family = family_for_config(config)
    shape = model_shape(config)
    check_fits(layout, shape)
    made_for = dtp_spec(layout.delta) if schedule is None else schedule
    table = made_for.resolve(shape.num_layers, layout.devices, last_scale)
    # An MoE family's fused experts are written one expert at a time, under its checkpoint names.
    tensors = CheckpointTensors(family, source.checkpoint_entries())
    names = tensors.entries
    rules = tensors.split_rules()
    devices = layout.devices
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = [itemsize * int(torch.Size(s).numel()) for _, s in names]
    file_of = checkpoint_files(sizes, max_shard_bytes)
    with ExitStack() as stack:
        ckpt_tmp = stack.enter_context(atomic_dir(checkpoint_dir, overwrite)) if checkpoint_dir is not None else None
        shard_tmp = stack.enter_context(atomic_dir(shards_dir, overwrite)) if shards_dir is not None else None
        writers: dict[str, SafetensorsWriter] = {}  # checkpoint file name → its writer
        if ckpt_tmp is not None:
            for file in dict.fromkeys(file_of.values()):
                entries = [(n, dtype, s) for k, (n, s) in enumerate(names) if file_of[k] == file]
                writers[file] = SafetensorsWriter(ckpt_tmp / file, entries, metadata={"format": "pt"})
                stack.callback(writers[file].abort)
        rank_writers: list[SafetensorsWriter] = []
        if shard_tmp is not None:
            for rank in range(devices):
                entries = [(n, dtype, local_shape(s, rules[n], devices)) for n, s in names]
                writer = SafetensorsWriter(shard_tmp / shard_file_name(rank), entries,
                                           metadata={"format": "pt", "rank": str(rank)})
                stack.callback(writer.abort)
                rank_writers.append(writer)
        for k, (name, _) in enumerate(names):
            check_stop()  # a safe point per tensor: a stopped job's export ends here, its writers aborted
            tensor = tensors.tensor(name, source.checkpoint_tensor)
            if permute and name in tensors.experts:
                tensor = tensors.permuted(name, tensor, layout)
            elif permute:
                tensor = permuted_tensor(name, tensor, family, shape, layout)
            tensor = tensor.to(dtype)
            if ckpt_tmp is not None:
                writers[file_of[k]].write(name, tensor)
            for rank, writer in enumerate(rank_writers):
                writer.write(name, rank_slice(tensor, rules[name], rank, devices).contiguous())
            del tensor
            return_freed_memory()
            if progress:
                progress("export", (k + 1) / len(names))
        if ckpt_tmp is not None:
            for writer in writers.values():
                writer.close()
            if len(writers) > 1:
                index = {"metadata": {"total_parameters": sum(int(torch.Size(s).numel()) for _, s in names),
                                      "total_size": sum(sizes)},
                         "weight_map": {name: file_of[k] for k, (name, _) in enumerate(names)}}
                (ckpt_tmp / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            source.save_configs(ckpt_tmp, dtype, generation=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(ckpt_tmp)
            (ckpt_tmp / LAYOUT_FILE).write_text(json.dumps(layout.to_json_dict()))
            drop_remote_code(ckpt_tmp)
        if shard_tmp is not None:
            for writer in rank_writers:
                writer.close()
            _write_manifest(shard_tmp, source, layout, table, rules, dtype=dtype,
                            compute_dtype=compute_dtype or source.dtype, tokenizer=tokenizer)
            drop_remote_code(shard_tmp)


def _write_manifest(shard_tmp: Path, source: LayerSource, layout: Layout, table: Any, rules: dict[str, Any], *,
                    dtype: torch.dtype, compute_dtype: torch.dtype, tokenizer: Any) -> None:
    """config.json (naming the DTP architecture), the tokenizer and manifest.json beside the rank files."""
    family = family_for_config(source.config)
    serving = serving_fields(model_shape(source.config).model_type, family.name, layout, table)
    files = []
    for rank in range(layout.devices):
        path = shard_tmp / shard_file_name(rank)
        files.append({"name": path.name, "rank": rank, "size": path.stat().st_size, "sha256": sha256_file(path)})
    source.save_configs(shard_tmp, dtype, generation=False)
    if tokenizer is not None:
        tokenizer.save_pretrained(shard_tmp)
    manifest = {
        "format": SHARDS_FORMAT,
        "devices": layout.devices,
        "delta": layout.delta,
        "layout": layout.to_json_dict(),
        # Additive to dtp-layout-shards/1: the schedule the shards are made for (absent: dtp:δ).
        "schedule": table.name,
        "split": rules,
        # Additive to dtp-layout-shards/1 (readers must not require them): the family's plan and dtype.
        "plan": family.plan.to_json_dict(),
        "dtype": dtype_name(dtype),
        "compute_dtype": dtype_name(compute_dtype),
        "files": files,
        # Additive: what a server (vLLM through models.serving.vllm) needs; config.json names the DTP model.
        "serving": serving,
    }
    write_serving_config(shard_tmp, serving)
    (shard_tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
