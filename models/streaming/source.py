"""Where a pass reads the model's weights from: a `LayerSource`, chosen once from the memory plan, feeds the
passes (affinity, evaluation, export) their layers, embeddings, final norm and head, and checkpoint tensors,
so that each pass's math is written once (as llm-compressor separates a modifier from the pipeline that feeds
it layers).

    ResidentModel   every weight in memory (a loaded Hugging Face model); micro-batches outer, layers
                    inner (`models.streaming.pipelines.by_micro_batch`)
    StreamedModel   a skeleton on the meta device, each layer read from safetensors when a pass needs it and
                    released after (`models.streaming.layer_source`); layers outer, micro-batches inner, their
                    residual streams kept between layers (`models.streaming.pipelines.by_layer`)

`layer_source(model)` is the one place that tells them apart: a loaded model is wrapped, a source is itself.
What one of them cannot do is refused by it (`whole_model`: a pass that needs every weight at once).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from models.sim.permute import decoder_layers, permute_

if TYPE_CHECKING:
    from models.base.progress import Progress, ShouldStop
    from models.layouts.layout import Layout
    from models.streaming.pipelines import LayerPass


class LayerSource(ABC):
    """A model's weights as a pass reads them: layer by layer, plus the ends (embeddings, final norm, head)."""

    config: Any
    model: Any  # the Hugging Face causal LM whose modules the pass calls (some may be on the meta device)
    device: torch.device
    dtype: torch.dtype  # the compute dtype
    memory_plan: Any = None  # models.streaming.memory_plan.MemoryPlan the run chose, where one did
    metadata: ClassVar[dict[str, str]] = {}  # what a pass's result records about where its weights came from

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    def layer(self, i: int) -> nn.Module:
        """Decoder layer i's module, materialised or not."""
        module: nn.Module = decoder_layers(self.model)[i]
        return module

    @abstractmethod
    def load_layer(self, i: int) -> nn.Module:
        """Decoder layer i with its weights."""

    @abstractmethod
    def release_layer(self, i: int) -> None:
        """Layer i's weights no longer needed by the pass."""

    @abstractmethod
    def load_embeddings(self) -> nn.Module: ...

    @abstractmethod
    def release_embeddings(self) -> None: ...

    @abstractmethod
    def load_head(self) -> None:
        """The final norm and the LM head."""

    @abstractmethod
    def release_all(self) -> None: ...

    @abstractmethod
    def whole_model(self, why: str) -> Any:
        """The model with every weight in memory, for a pass that needs them at once; `why` names that pass
        where the source cannot give it (MemoryLimitError)."""

    @abstractmethod
    def permuted(self, layout: Layout) -> LayerSource:
        """The same weights with `layout` realised (`models.sim.permute`), layer i's read while this
        source's layer i is loaded: sharing the embeddings, final norm and head."""

    @abstractmethod
    def run(self, pass_: LayerPass, batches: list[torch.Tensor], *, label: str, stage: str,
            progress: Progress | None = None, should_stop: ShouldStop | None = None,
            spill_dir: Path | None = None) -> None:
        """Feed `pass_` every layer for every micro-batch (`models.streaming.pipelines`), in this source's order."""

    # ---- checkpoint tensors (the export) ---------------------------------------------------------------

    def checkpoint_entries(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every tensor a checkpoint holds, in state-dict order, the tied lm_head left out."""
        state = self.model.state_dict()
        if getattr(self.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        return [(name, tuple(t.shape)) for name, t in state.items()]

    @abstractmethod
    def checkpoint_tensor(self, name: str) -> torch.Tensor:
        """One checkpoint tensor in the compute dtype, as loading casts it."""

    @abstractmethod
    def save_configs(self, out: Path, dtype: torch.dtype, *, generation: bool) -> None:
        """config.json as `save_pretrained` writes it for weights in `dtype` (and generation_config.json)."""


class ResidentModel(LayerSource):
    """A loaded model: every weight in memory, nothing to load or release."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.config = model.config
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        self._state: dict[str, torch.Tensor] | None = None

    def load_layer(self, i: int) -> nn.Module:
        return self.layer(i)

    def release_layer(self, i: int) -> None:
        pass

    def load_embeddings(self) -> nn.Module:
        embed: nn.Module = self.model.model.embed_tokens
        return embed

    def release_embeddings(self) -> None:
        pass

    def load_head(self) -> None:
        pass

    def release_all(self) -> None:
        pass

    def whole_model(self, why: str) -> Any:
        return self.model

    def permuted(self, layout: Layout) -> LayerSource:
        """A permuted deep copy (the model's weights twice, as the memory plan counts them)."""
        return ResidentModel(permute_(copy.deepcopy(self.model), layout))

    def run(self, pass_: LayerPass, batches: list[torch.Tensor], *, label: str, stage: str,
            progress: Progress | None = None, should_stop: ShouldStop | None = None,
            spill_dir: Path | None = None) -> None:
        from models.streaming.pipelines import by_micro_batch

        by_micro_batch(self, pass_, batches, label=label, stage=stage, progress=progress, should_stop=should_stop)

    def checkpoint_tensor(self, name: str) -> torch.Tensor:
        if self._state is None:
            self._state = self.model.state_dict()  # detached views of the parameters, no copy
        return self._state[name]

    def save_configs(self, out: Path, dtype: torch.dtype, *, generation: bool) -> None:
        """As `save_pretrained` writes them: config.json with the weights' dtype and the model's class as its
        architecture; the model's own generation config where it generates."""
        saved = copy.deepcopy(self.config)
        saved.dtype = str(dtype).removeprefix("torch.")
        saved.architectures = [type(self.model).__name__.removeprefix("FSDP")]
        saved.save_pretrained(out)
        if generation and self.model.can_generate():
            self.model.generation_config.save_pretrained(out)


def layer_source(model: Any) -> LayerSource:
    """The source a pass reads `model` through: a `LayerSource` (a `StreamedModel`) as it is, a loaded model
    resident. The one place that tells a streamed model from a loaded one."""
    return model if isinstance(model, LayerSource) else ResidentModel(model)

