"""`streamed_affinity_pass`: the name the streamed affinity pass had, kept for its callers. There is one pass,
`models.affinity.scoring.affinity_pass`, which a `StreamedModel` feeds layer by layer
(`models.streaming.pipelines.by_layer`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from models.affinity.scoring import AffinityResult, affinity_pass
from models.streaming.layer_source import StreamedModel


def streamed_affinity_pass(streamed: StreamedModel, blocks: torch.Tensor, *, spill_dir: Path | None = None,
                           **options: Any) -> AffinityResult:
    """`affinity_pass` over a `StreamedModel`: the same result, two layers in memory."""
    return affinity_pass(streamed, blocks, spill_dir=spill_dir, **options)
