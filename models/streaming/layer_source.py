"""A model read layer by layer from its safetensors files: the skeleton on the meta device, a decoder
layer's weights materialised when a pass needs them and released after, as llm-compressor's sequential
pipeline and accelerate's `init_empty_weights` do.

    streamed = StreamedModel.open(directory, dtype=torch.float32)   # config + meta skeleton, no weight
    streamed.load_embeddings()                                      # embed_tokens (and a tied lm_head)
    with streamed.layers(i, i + 1):                                 # layers i and i+1 materialised …
        ...                                                         # … and released on exit
    streamed.tensor("model.layers.3.mlp.up_proj.weight")            # one tensor, in its stored dtype

Reads go through safetensors' `safe_open`, one file opened per read and closed after it, so that its
memory map does not keep the pages it touched resident (they would count in the process's RSS). A
tensor is cast to the compute dtype as `from_pretrained(dtype=…)` casts it, so the materialised
parameters equal the in-memory model's. The skeleton's rotary embedding (a buffer computed from the
config, not a checkpoint tensor) is rebuilt on the device.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from models.families import family_for_config, model_shape
from models.io.loading import ModelLoadError
from models.streaming.experts import read_parameters
from models.streaming.source import LayerSource

if TYPE_CHECKING:
    from models.base.progress import Progress, ShouldStop
    from models.layouts.layout import Layout
    from models.streaming.pipelines import LayerPass

INDEX = "model.safetensors.index.json"
LAYER_PREFIX = "model.layers."


@dataclass(frozen=True)
class TensorInfo:
    """A stored tensor's file, dtype name (safetensors' `F32`, `BF16` …) and shape, read from headers."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


def _header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size <= 0 or size > 100_000_000:
            raise ModelLoadError(f"{path}: not a safetensors file (header size {size})")
        header: dict[str, Any] = json.loads(f.read(size))
    return header


class CheckpointReader:
    """The tensors of a safetensors checkpoint directory (one file or an index of several), read lazily."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{self.directory}: no *.safetensors file to stream from")
        self.tensors: dict[str, TensorInfo] = {}
        for path in files:
            for name, entry in _header(path).items():
                if name != "__metadata__":
                    self.tensors[name] = TensorInfo(path, entry["dtype"], tuple(entry["shape"]))

    def names(self) -> list[str]:
        return list(self.tensors)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors as stored, each file opened once and closed after (its map unmapped)."""
        missing = [n for n in names if n not in self.tensors]
        if missing:
            raise ModelLoadError(f"{self.directory}: the checkpoint has no tensor {missing[0]!r}")
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.tensors[name].file, []).append(name)
        out: dict[str, torch.Tensor] = {}
        for path, in_file in by_file.items():
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in in_file:
                    out[name] = f.get_tensor(name)
        return {name: out[name] for name in names}

    def tensor(self, name: str) -> torch.Tensor:
        return self.read([name])[name]


def skeleton(config: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """The causal LM with every parameter on the meta device (no memory), its rotary buffers real."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # never trust_remote_code
    _rebuild_rotary(model, config, device)
    return model.eval()


def checkpoint_names(config: Any, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor a checkpoint of `config` holds, in the model's state-dict order (the
    tied lm_head left out), from the meta skeleton."""
    state = skeleton(config, dtype, torch.device("cpu")).state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return [(name, tuple(t.shape)) for name, t in state.items()]


def _rebuild_rotary(model: Any, config: Any, device: torch.device) -> None:
    """The rotary embedding's buffers (inv_freq, from the config) computed for real on `device`."""
    inner = model.model
    with torch.device(device):
        inner.rotary_emb = type(inner.rotary_emb)(config=config)


# glibc's malloc raises its mmap threshold to the size of each freed block (up to 32 MiB), after which a
# layer's tensors come from the heap, and freeing them does not give the pages back to the system: the
# process's RSS would grow to several layers. `malloc_trim(0)` after each release returns the free pages
# of every arena (once per layer: no cost per allocation, unlike a fixed MALLOC_MMAP_THRESHOLD_).
def _libc() -> Any:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


_LIBC = _libc()


def return_freed_memory() -> bool:
    """Give the freed pages of the C heap back to the system; False where the C library is not glibc."""
    trim = getattr(_LIBC, "malloc_trim", None)
    return bool(trim is not None and trim(0))


class StreamedModel(LayerSource):
    """A checkpoint directory's model on the meta device, materialised module by module."""

    metadata: ClassVar[dict[str, str]] = {"streamed": "true"}  # recorded in a pass's result (the affinity file)

    def __init__(self, directory: Path, config: Any, *, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.family = family_for_config(config)  # refuse an unsupported architecture before anything is read
        self.directory = Path(directory)
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.reader = CheckpointReader(self.directory)
        self.model = skeleton(config, dtype, self.device)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.memory_plan: Any = None  # models.streaming.memory_plan.MemoryPlan the run chose (spill or not)

    @classmethod
    def open(cls, directory: Path, *, dtype: torch.dtype, device: torch.device | str = "cpu") -> StreamedModel:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=False)
        return cls(directory, config, dtype=dtype, device=device)

    # ---- materialising and releasing --------------------------------------------------------------------

    def _materialise(self, module: nn.Module, prefix: str) -> None:
        names = [f"{prefix}{name}" for name, _ in module.named_parameters()]
        # an MoE layer's fused experts from the checkpoint's per-expert tensors (models.streaming.experts)
        stored = read_parameters(self.reader, names, self.family, self.config)
        state = {name[len(prefix):]: t.to(device=self.device, dtype=self.dtype) for name, t in stored.items()}
        module.load_state_dict(state, assign=True, strict=True)

    @staticmethod
    def release(module: nn.Module) -> None:
        """Back to the meta device: the module's weights are freed (no other reference holds them)."""
        module.to_empty(device="meta")
        return_freed_memory()

    def load_layer(self, i: int) -> nn.Module:
        layer = self.layer(i)
        if next(layer.parameters()).is_meta:
            self._materialise(layer, f"{LAYER_PREFIX}{i}.")
        return layer

    def release_layer(self, i: int) -> None:
        self.release(self.layer(i))

    @contextmanager
    def layers(self, *indices: int) -> Iterator[list[nn.Module]]:
        """Layers materialised for the block, released after it."""
        try:
            yield [self.load_layer(i) for i in indices]
        finally:
            for i in indices:
                self.release_layer(i)

    def release_embeddings(self) -> None:
        """embed_tokens back to the meta device (and the tied lm_head, which holds the same weight)."""
        self.release(self.model.model.embed_tokens)
        if self.tied:
            self.release(self.model.lm_head)

    def load_embeddings(self) -> nn.Module:
        embed: nn.Module = self.model.model.embed_tokens
        if next(embed.parameters()).is_meta:
            self._materialise(embed, "model.embed_tokens.")
            if self.tied:
                self.model.lm_head.weight = embed.weight
        return embed

    def load_head(self) -> None:
        """The final norm and the LM head (the tied embedding where the config ties them)."""
        norm: nn.Module = self.model.model.norm
        if next(norm.parameters()).is_meta:
            self._materialise(norm, "model.norm.")
        if self.tied:
            self.load_embeddings()
        elif self.model.lm_head.weight.is_meta:
            self._materialise(self.model.lm_head, "lm_head.")

    def release_all(self) -> None:
        self.model.to_empty(device="meta")
        _rebuild_rotary(self.model, self.config, self.device)

    # ---- what a pass asks of its source (models.streaming.source.LayerSource) ----------------------------

    def whole_model(self, why: str) -> Any:
        from models.streaming.memory_plan import MemoryLimitError

        raise MemoryLimitError(f"the model is streamed layer by layer to fit max_memory, and {why}: give a larger "
                               f"max_memory (or none), or a schedule of the chain (dtp:1, spd:B)")

    def permuted(self, layout: Layout) -> LayerSource:
        return PermutedLayers(self, layout)

    def run(self, pass_: LayerPass, batches: list[torch.Tensor], *, label: str, stage: str,
            progress: Progress | None = None, should_stop: ShouldStop | None = None,
            spill_dir: Path | None = None) -> None:
        from models.streaming.pipelines import by_layer

        by_layer(self, pass_, batches, label=label, stage=stage, progress=progress, should_stop=should_stop,
                 spill_dir=spill_dir)

    def checkpoint_tensor(self, name: str) -> torch.Tensor:
        """Read from its file and cast to the compute dtype, as `from_pretrained(dtype=…)` casts it (an MoE's fused
        expert parameter stacked from the checkpoint's per-expert tensors, `models.streaming.experts`)."""
        return read_parameters(self.reader, [name], self.family, self.config)[name].to(self.dtype)

    def save_configs(self, out: Path, dtype: torch.dtype, *, generation: bool) -> None:
        """config.json as save_pretrained writes it for weights in `dtype`; generation_config.json as the
        in-memory model carries it (the source's, else derived from the config)."""
        saved = copy.deepcopy(self.config)
        saved.dtype = str(dtype).removeprefix("torch.")
        saved.save_pretrained(out)
        if generation:
            if (self.directory / "generation_config.json").is_file():
                shutil.copyfile(self.directory / "generation_config.json", out / "generation_config.json")
            else:
                from transformers import GenerationConfig

                GenerationConfig.from_model_config(self.config).save_pretrained(out)


class PermutedLayers(StreamedModel):
    """A `StreamedModel`'s layers with a layout realised: its own meta skeleton of the decoder layers, sharing
    the embeddings, final norm, head and rotary embedding of `base`; layer i is made from `base`'s loaded
    layer i (its tensors shared, the planned linears index-selected: `models.sim.permute.reorder_layer_`,
    as `permute_` permutes a whole model) and released after."""

    def __init__(self, base: StreamedModel, layout: Layout) -> None:
        from models.layouts.layout import check_fits

        self.base, self.layout = base, layout
        self.directory, self.config, self.dtype, self.device = base.directory, base.config, base.dtype, base.device
        self.reader, self.tied, self.memory_plan = base.reader, base.tied, base.memory_plan
        self.family, self.shape = family_for_config(self.config), model_shape(self.config)
        check_fits(layout, self.shape)
        self.model = skeleton(self.config, self.dtype, self.device)
        inner, own = base.model.model, self.model.model
        own.embed_tokens, own.norm, own.rotary_emb = inner.embed_tokens, inner.norm, inner.rotary_emb
        self.model.lm_head = base.model.lm_head

    def load_layer(self, i: int) -> nn.Module:
        from models.sim.permute import reorder_layer_

        layer = self.layer(i)
        if next(layer.parameters()).is_meta:
            layer.load_state_dict(self.base.load_layer(i).state_dict(), assign=True, strict=True)
            reorder_layer_(layer, self.family, self.shape, self.layout.group_order(i), self.layout.neuron_order(i))
        return layer

    def release_all(self) -> None:
        for i in range(self.num_layers):
            self.release_layer(i)
        self.base.release_all()


def checkpoint_directory(source: Any, *, dtype: str, converted: Any = None) -> Path:
    """The local safetensors directory a `models.io.loading.ModelSource` streams from: a local directory as
    is, a hub id's snapshot (fetched by huggingface_hub, safetensors only), a GGUF's converted copy
    (`models.io.converted`: made by one full load the first time)."""
    where, gguf = source.resolved()
    if gguf:
        from models.io.converted import ConvertedCache

        cache = converted if converted is not None else ConvertedCache()
        return Path(cache.converted_source(source, dtype=dtype).path_or_id)
    if Path(where).is_dir():
        return Path(where)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(where, revision=source.revision,
                                      allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"]))
    except Exception as exc:  # offline cache miss, missing repo, network
        raise ModelLoadError(f"model {source.path_or_id!r}: cannot fetch its safetensors: "
                             f"{type(exc).__name__}: {exc}") from exc
