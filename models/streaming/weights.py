"""Opening a model's weights the way the memory plan chose (`open_weights`): the one place a run picks its
pipeline, a `StreamedModel` read layer by layer or the model loaded whole (`models.streaming.source`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Weights:
    """A model's weights opened the way the memory plan chose, with its tokenizer."""

    model: Any  # a loaded Hugging Face model, or a StreamedModel (its skeleton carries the config)
    tokenizer: Any
    read_from: Any  # the models.io.loading.ModelSource read: a GGUF's converted copy where one was used


def open_weights(source: Any, config: Any, *, plan: Any, dtype: str, device: str = "cpu",
                 converted: Any = None) -> Weights:
    """The one place a run chooses its pipeline: when `plan` (a models.streaming.memory_plan.MemoryPlan, or
    None) streams, a `StreamedModel` over the model's safetensors (a GGUF's converted copy, a hub model's
    snapshot), read layer by layer; otherwise the model loaded whole (a GGUF through `converted`, a
    models.io.converted.ConvertedCache, when given)."""
    from models.io.loading import DTYPES, ModelSource, load_model, load_tokenizer, resolve_device

    if plan is not None and plan.stream:
        from models.streaming.layer_source import StreamedModel, checkpoint_directory

        directory = checkpoint_directory(source, dtype=dtype, converted=converted)
        streamed = StreamedModel(directory, config, dtype=DTYPES[dtype], device=resolve_device(device))
        read_from = ModelSource(str(directory))
        return Weights(streamed, load_tokenizer(read_from), read_from)
    if converted is not None:  # a GGUF is dequantised on its first load only
        source = converted.converted_source(source, dtype=dtype)
    return Weights(load_model(source, dtype=dtype, device=device), load_tokenizer(source), source)
