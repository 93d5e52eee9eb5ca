"""The two orders in which a `LayerSource` feeds a pass its layers (llm-compressor's basic and sequential
pipelines); the pass (`LayerPass`: the affinity's sums, the evaluation's streams) is written once for both.

    by_micro_batch   every weight resident: for each micro-batch, the embeddings, every layer, the head;
                     a micro-batch's streams live only while it runs
    by_layer         layers read one at a time: every micro-batch through the embeddings, then through
                     layer 0, 1, … (their streams kept between layers: `models.streaming.hidden_states`, in
                     memory or spilled to disk), then the final norm and head; layer i is closed once layer
                     i+1 is read (a pass may read both then) and released

Each micro-batch meets the same operations in the same order either way, so the results are equal to the
bit. Progress is reported per layer and micro-batch; `should_stop` is polled before each micro-batch (and,
layer by layer, before each layer's micro-batch).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from models.base.progress import Cancelled, Progress, ShouldStop
from models.streaming.hidden_states import HiddenStates

if TYPE_CHECKING:
    from models.streaming.source import LayerSource


class LayerPass(Protocol):
    """What a pass does with the layers it is fed."""

    needs_head: bool  # whether `finish` reads the final norm and the LM head

    def start(self, ids: torch.Tensor) -> Any:
        """A micro-batch's state from its token ids [B, S] (the embeddings are loaded)."""
        ...

    def step(self, i: int, layer: nn.Module, ids: torch.Tensor, state: Any) -> Any:
        """Decoder layer i (loaded) on one micro-batch's state; returns its state after the layer."""
        ...

    def close(self, i: int, layer: nn.Module, next_layer: nn.Module | None) -> None:
        """Every micro-batch has been through layer i; layer i+1 (None after the last) is loaded too."""
        ...

    def finish(self, ids: torch.Tensor, state: Any) -> None:
        """A micro-batch after the last layer (the final norm and head loaded where `needs_head`; layer by
        layer, every micro-batch's last layer comes first)."""
        ...


def by_micro_batch(source: LayerSource, pass_: LayerPass, batches: list[torch.Tensor], *, label: str,
                   stage: str, progress: Progress | None = None, should_stop: ShouldStop | None = None) -> None:
    """Micro-batches outer, layers inner; every layer closed at the end, in order."""
    n_layers, n_blocks = source.num_layers, sum(ids.shape[0] for ids in batches)
    layers = [source.load_layer(i) for i in range(n_layers)]
    done = 0
    for ids in batches:
        if should_stop is not None and should_stop():
            raise Cancelled(f"{label} cancelled after {done} of {n_blocks} blocks")
        state = pass_.start(ids)
        for i, layer in enumerate(layers):
            state = pass_.step(i, layer, ids, state)
            if progress is not None:  # per layer: a micro-batch of a large model is minutes on a CPU
                progress(stage, (done + ids.shape[0] * (i + 1) / n_layers) / n_blocks)
        pass_.finish(ids, state)
        done += ids.shape[0]
    for i, layer in enumerate(layers):
        pass_.close(i, layer, layers[i + 1] if i + 1 < n_layers else None)


def by_layer(source: LayerSource, pass_: LayerPass, batches: list[torch.Tensor], *, label: str, stage: str,
             progress: Progress | None = None, should_stop: ShouldStop | None = None,
             spill_dir: Path | None = None) -> None:
    """Layers outer, micro-batches inner: at most two decoder layers loaded (layer i-1 until layer i's read)."""
    n_layers = source.num_layers
    states = HiddenStates(spill_dir)
    try:
        source.load_embeddings()
        for b, ids in enumerate(batches):
            states.put(b, pass_.start(ids))
        source.release_embeddings()
        layer: nn.Module | None = None
        for i in range(n_layers):
            previous, layer = layer, source.load_layer(i)
            if previous is not None:  # layer i-1's close may read layer i's weights
                pass_.close(i - 1, previous, layer)
                source.release_layer(i - 1)
            last = i == n_layers - 1
            for b, ids in enumerate(batches):
                if should_stop is not None and should_stop():
                    raise Cancelled(f"{label} cancelled in layer {i} of {n_layers}")
                state = pass_.step(i, layer, ids, states.get(b, source.device))
                if not last or pass_.needs_head:
                    states.put(b, state)
                else:
                    pass_.finish(ids, state)
                if progress is not None:
                    progress(stage, (i + (b + 1) / len(batches)) / n_layers)
        assert layer is not None
        pass_.close(n_layers - 1, layer, None)
        source.release_layer(n_layers - 1)
        if pass_.needs_head:
            source.load_head()
            for b, ids in enumerate(batches):
                pass_.finish(ids, states.get(b, source.device))
    finally:
        states.close()
        source.release_all()
