"""`streamed_export`: the export of a checkpoint directory read tensor by tensor, by the name it had; there is
one export (`models.export.writer.export_layout`), which a `StreamedModel` feeds from its safetensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from models.export.writer import DEFAULT_SHARD_BYTES, export_layout
from models.layouts.layout import Layout
from models.run.progress import Progress
from models.schedules.grammar import LastScale
from models.streaming.layer_source import StreamedModel, skeleton


def checkpoint_names(config: Any, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor a checkpoint of `config` holds, in the model's state-dict order (the
    tied lm_head left out), from the meta skeleton."""
    model = skeleton(config, dtype, torch.device("cpu"))
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return [(name, tuple(t.shape)) for name, t in state.items()]


def streamed_export(source_dir: Path, config: Any, layout: Layout, out_dir: Path, *, dtype: torch.dtype,
                    compute_dtype: torch.dtype, checkpoint: bool = True, shards: bool = True, tokenizer: Any = None,
                    overwrite: bool = False, progress: Progress | None = None,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES, schedule: str | None = None,
                    last_scale: LastScale = "sqrt") -> None:
    """`out_dir/checkpoint` and/or `out_dir/shards` for `layout`, from the checkpoint in `source_dir`."""
    source = StreamedModel(Path(source_dir), config, dtype=compute_dtype)
    out_dir = Path(out_dir)
    export_layout(source, layout, checkpoint_dir=out_dir / "checkpoint" if checkpoint else None,
                  shards_dir=out_dir / "shards" if shards else None, dtype=dtype, tokenizer=tokenizer,
                  overwrite=overwrite, progress=progress, max_shard_bytes=max_shard_bytes, schedule=schedule,
                  last_scale=last_scale)
