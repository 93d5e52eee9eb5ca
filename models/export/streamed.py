"""The export streamed tensor by tensor (`models.export.resident` is the in-memory one): the permuted Hugging Face
checkpoint and every rank shard are written without ever holding the model.

Every checkpoint tensor is read from the source's safetensors (`models.streaming.layer_source.CheckpointReader`),
cast to the compute dtype as loading casts it, permuted (`models.sim.permute.permuted_tensor`, the same
index_select as `permute_`), cast to the export dtype, and appended to its checkpoint file and to each
rank's shard file (`models.streaming.safetensors_reader.SafetensorsWriter`: headers first, from the shapes alone),
then dropped. So the tensors are bit-identical to the in-memory export's; the checkpoint's files are split
at `max_shard_bytes` as `save_pretrained` splits them (`model-0000K-of-0000N.safetensors` and
`model.safetensors.index.json`, or one `model.safetensors`), and the shards directory is the same
`dtp-layout-shards/1` (one file per rank, manifest.json). Peak memory: a few copies of the largest
tensor (the embedding).
"""

from __future__ import annotations

import copy
import json
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from models.export.resident import (
    LAYOUT_FILE,
    MANIFEST,
    SHARDS_FORMAT,
    atomic_dir,
    dtype_name,
    sha256_file,
    shard_file_name,
)
from models.families import family_for_config, model_shape
from models.families.plan import local_shape, rank_slice
from models.layouts.layout import Layout, check_fits
from models.run.progress import Progress
from models.schedules.grammar import LastScale, resolve_schedule
from models.serving.manifest import serving_fields, write_serving_config
from models.sim.permute import permuted_tensor
from models.streaming.layer_source import CheckpointReader, return_freed_memory, skeleton
from models.streaming.safetensors_reader import SafetensorsWriter

SAFE_INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 * 10**9  # save_pretrained's default max_shard_size, "2GB"


def checkpoint_names(config: Any, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor a checkpoint of `config` holds, in the model's state-dict order (the
    tied lm_head left out, as `models.export.resident.checkpoint_state` leaves it), from the meta skeleton."""
    model = skeleton(config, dtype, torch.device("cpu"))
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return [(name, tuple(t.shape)) for name, t in state.items()]


def _file_groups(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Consecutive tensors in files of at most max_bytes each (a larger tensor alone in its file)."""
    groups: list[list[int]] = [[]]
    total = 0
    for k, size in enumerate(sizes):
        if groups[-1] and total + size > max_bytes:
            groups.append([])
            total = 0
        groups[-1].append(k)
        total += size
    return groups


def _save_configs(config: Any, dtype: torch.dtype, source_dir: Path, out: Path, *, generation: bool) -> None:
    """config.json as save_pretrained writes it for weights in `dtype`; generation_config.json as the
    in-memory model carries it (the source's, else derived from the config)."""
    saved = copy.deepcopy(config)
    saved.dtype = dtype_name(dtype)
    saved.save_pretrained(out)
    if generation:
        if (source_dir / "generation_config.json").is_file():
            shutil.copyfile(source_dir / "generation_config.json", out / "generation_config.json")
        else:
            from transformers import GenerationConfig

            GenerationConfig.from_model_config(config).save_pretrained(out)


def streamed_export(source_dir: Path, config: Any, layout: Layout, out_dir: Path, *, dtype: torch.dtype,
                    compute_dtype: torch.dtype, checkpoint: bool = True, shards: bool = True, tokenizer: Any = None,
                    overwrite: bool = False, progress: Progress | None = None,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES, schedule: str | None = None,
                    last_scale: LastScale = "sqrt") -> None:
    """`out_dir/checkpoint` and/or `out_dir/shards` for `layout`, from the checkpoint in `source_dir`;
    `schedule` as for export_rank_shards (the manifest records the schedule the shards are made for)."""
    family = family_for_config(config)
    shape = model_shape(config)
    check_fits(layout, shape)
    table = resolve_schedule(schedule or f"dtp:{layout.delta}", shape.num_layers, layout.devices, last_scale)
    made_for = table.name
    reader = CheckpointReader(Path(source_dir))
    names = checkpoint_names(config, compute_dtype)
    rules = family.plan.split_rules([n for n, _ in names])
    devices = layout.devices
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = [itemsize * int(torch.Size(s).numel()) for _, s in names]
    groups = _file_groups(sizes, max_shard_bytes)
    files = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    file_of = {k: files[g] for g, members in enumerate(groups) for k in members}
    out_dir = Path(out_dir)
    with ExitStack() as stack:
        ckpt_tmp = stack.enter_context(atomic_dir(out_dir / "checkpoint", overwrite)) if checkpoint else None
        shard_tmp = stack.enter_context(atomic_dir(out_dir / "shards", overwrite)) if shards else None
        rank_writers: list[SafetensorsWriter] = []
        if shard_tmp is not None:
            for rank in range(devices):
                entries = [(n, dtype, local_shape(s, rules[n], devices)) for n, s in names]
                writer = SafetensorsWriter(shard_tmp / shard_file_name(rank), entries,
                                           metadata={"format": "pt", "rank": str(rank)})
                stack.callback(writer.abort)
                rank_writers.append(writer)
        ckpt_writer: SafetensorsWriter | None = None
        for k, (name, _) in enumerate(names):
            stored = reader.tensor(name)
            tensor = permuted_tensor(name, stored.to(compute_dtype), family, shape, layout).to(dtype)
            del stored
            if ckpt_tmp is not None:
                if ckpt_writer is None:
                    group = next(g for g in groups if k in g)
                    ckpt_writer = SafetensorsWriter(ckpt_tmp / file_of[k],
                                                    [(names[j][0], dtype, names[j][1]) for j in group],
                                                    metadata={"format": "pt"})
                ckpt_writer.write(name, tensor)
                if k == groups[files.index(file_of[k])][-1]:
                    ckpt_writer.close()
                    ckpt_writer = None
            for rank, writer in enumerate(rank_writers):
                writer.write(name, rank_slice(tensor, rules[name], rank, devices).contiguous())
            del tensor
            return_freed_memory()
            if progress:
                progress("export", (k + 1) / len(names))
        if ckpt_tmp is not None:
            if len(files) > 1:
                index = {"metadata": {"total_size": sum(sizes)},
                         "weight_map": {name: file_of[k] for k, (name, _) in enumerate(names)}}
                (ckpt_tmp / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            _save_configs(config, dtype, Path(source_dir), ckpt_tmp, generation=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(ckpt_tmp)
            (ckpt_tmp / LAYOUT_FILE).write_text(json.dumps(layout.to_json_dict()))
        if shard_tmp is not None:
            for writer in rank_writers:
                writer.close()
            serving = serving_fields(shape.model_type, family.name, layout, table)
            entries_out = []
            for rank in range(devices):
                path = shard_tmp / shard_file_name(rank)
                entries_out.append({"name": path.name, "rank": rank, "size": path.stat().st_size,
                                    "sha256": sha256_file(path)})
            _save_configs(config, dtype, Path(source_dir), shard_tmp, generation=False)
            if tokenizer is not None:
                tokenizer.save_pretrained(shard_tmp)
            manifest = {
                "format": SHARDS_FORMAT,
                "devices": devices,
                "delta": layout.delta,
                "layout": layout.to_json_dict(),
                "schedule": made_for,  # as export_rank_shards writes it
                "split": rules,
                "plan": family.plan.to_json_dict(),
                "dtype": dtype_name(dtype),
                "compute_dtype": dtype_name(compute_dtype),
                "files": entries_out,
                "serving": serving,  # as export_rank_shards writes it
            }
            write_serving_config(shard_tmp, serving)
            (shard_tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
