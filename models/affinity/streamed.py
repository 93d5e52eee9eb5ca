"""The affinity pass streamed layer by layer (`models.affinity.scoring` is the in-memory one): layers outer,
micro-batches inner, so that only a window of two decoder layers is ever materialised.

For layer i: materialise it, run every micro-batch's residual stream through it (the same
`layer_step` as the in-memory pass: the same sums in the same order, so the same affinity), then
materialise layer i+1 and compute layer i's terms, whose down score reads layer i+1's q/k/v
(`layer_terms`), and release layer i. The residual streams of the calibration blocks are kept between
layers (`models.streaming.hidden_states`: in memory, or spilled to disk).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from models.affinity.scoring import AffinityResult, Cancelled, LayerAccumulator, _fold, layer_step, layer_terms
from models.families import model_shape
from models.run.progress import Progress, ShouldStop
from models.sim.dtp import DTPModel
from models.streaming.hidden_states import HiddenStates
from models.streaming.layer_source import StreamedModel


@torch.no_grad()
def streamed_affinity_pass(streamed: StreamedModel, blocks: torch.Tensor, *, batch_size: int = 4,
                           token_chunk: int = 128, neuron_block: int = 1024, progress: Progress | None = None,
                           should_stop: ShouldStop | None = None, metadata: dict[str, str] | None = None,
                           spill_dir: Path | None = None) -> AffinityResult:
    """`models.affinity.scoring.affinity_pass` over a `StreamedModel`: the same result, two layers in memory."""
    model = streamed.model
    shape = model_shape(model.config)
    dense = DTPModel(model, devices=1, delta=0)  # reads each layer's parameters when called
    device, n_layers = streamed.device, shape.num_layers
    n_blocks = blocks.shape[0]
    starts = list(range(0, n_blocks, batch_size))
    t0 = time.perf_counter()
    hidden = HiddenStates(spill_dir)
    try:
        embed = streamed.load_embeddings()
        batch_shapes = []
        for b, start in enumerate(starts):
            emb = embed(blocks[start : start + batch_size].to(device))  # [B, S, D]
            batch_shapes.append(emb.shape)
            hidden.put(b, emb.reshape(-1, emb.shape[-1]))  # [T, D]
        streamed.release(embed)
        if streamed.tied:
            streamed.release(model.lm_head)
        up_fo: list[Any] = []
        up_add: list[Any] = []
        down: list[Any] = []
        acc: LayerAccumulator | None = None
        for i in range(n_layers):
            layer = streamed.load_layer(i)
            if acc is not None:  # layer i-1's terms: its down score reads layer i's attention weights
                _terms(acc, streamed.layer(i - 1), layer, shape, blocks, up_fo, up_add, down)
                streamed.release_layer(i - 1)
            acc = LayerAccumulator(shape.num_query_heads, shape.intermediate_size, device)
            fold = _fold(layer, shape.num_query_heads, shape.head_dim, neuron_block)
            for b, start in enumerate(starts):
                if should_stop is not None and should_stop():
                    raise Cancelled(f"affinity pass cancelled in layer {i} of {n_layers}")
                ids = blocks[start : start + batch_size].to(device)
                cos, sin = dense.rotary(ids, torch.empty(0, dtype=streamed.dtype, device=device))
                x = layer_step(dense, i, hidden.get(b, device), batch_shapes[b], cos, sin, acc, fold,
                               token_chunk, last=i == n_layers - 1)
                if i < n_layers - 1:
                    hidden.put(b, x)
                if progress is not None:
                    progress("affinity", (i + (b + 1) / len(starts)) / n_layers)
            del fold
        assert acc is not None
        _terms(acc, streamed.layer(n_layers - 1), None, shape, blocks, up_fo, up_add, down)
        streamed.release_layer(n_layers - 1)
    finally:
        hidden.close()
        streamed.release_all()
    result = AffinityResult(up_fo, up_add, down, int(blocks.numel()), shape)
    result.metadata.update(metadata or {})
    result.metadata["seconds"] = f"{time.perf_counter() - t0:.3f}"
    result.metadata["streamed"] = "true"
    return result


def _terms(acc: LayerAccumulator, layer: Any, next_layer: Any | None, shape: Any, blocks: torch.Tensor,
           up_fo: list[Any], up_add: list[Any], down: list[Any]) -> None:
    fo, add, dn = layer_terms(acc, layer, next_layer, shape, int(blocks.numel()))
    up_fo.append(fo)
    up_add.append(add)
    if dn is not None:
        down.append(dn)
