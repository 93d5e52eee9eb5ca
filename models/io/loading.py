"""Loading checkpoints safely: hub ids (+ revision), local directories, local GGUF files.

Never `trust_remote_code`; weights from safetensors only (GGUF files are dequantised by
transformers' GGUF loader). The architecture is checked from the config before any weight is read.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from models.base.progress import check_stop
from models.families import family_for_config
from models.io.ids import DTYPE_NAMES, GGUF_FILE, HUB_ID, REVISION

if TYPE_CHECKING:
    from models.io.converted import ConvertedCache

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}  # "float32" → torch.float32


class ModelLoadError(ValueError):
    """The model source is malformed, missing, unsafe or unreadable."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: `path_or_id` is a local directory, a local .gguf file or a hub id."""

    path_or_id: str
    revision: str | None = None
    gguf_file: str | None = None

    def resolved(self) -> tuple[str, str | None]:
        """(directory or hub id, gguf file name) for transformers' from_pretrained."""
        path = Path(self.path_or_id)
        if path.suffix == ".gguf":
            if self.gguf_file:
                raise ModelLoadError("give either a .gguf path or gguf_file, not both")
            if not path.is_file():
                raise ModelLoadError(f"model: GGUF file {path} does not exist")
            return str(path.parent), path.name
        if self.gguf_file is not None and not GGUF_FILE.match(self.gguf_file):
            raise ModelLoadError(f"gguf_file must be a plain file name ending in .gguf, got {self.gguf_file!r}")
        if path.is_dir():
            return str(path), self.gguf_file
        if self.path_or_id.startswith((".", "/", "~")) or path.exists():
            raise ModelLoadError(f"model: {self.path_or_id!r} is not a directory or a .gguf file")
        if not HUB_ID.match(self.path_or_id) or ".." in self.path_or_id:
            raise ModelLoadError(
                f"model: {self.path_or_id!r} is neither a local directory, a .gguf file nor a hub id of the "
                "form 'owner/name' (letters, digits, '.', '_', '-')"
            )
        if self.revision is not None and (not REVISION.match(self.revision) or ".." in self.revision):
            raise ModelLoadError(f"revision {self.revision!r} is not a valid branch, tag or commit")
        return self.path_or_id, self.gguf_file

    def kwargs(self) -> dict[str, Any]:
        where, gguf = self.resolved()
        kw: dict[str, Any] = {"trust_remote_code": False}
        if gguf:
            kw["gguf_file"] = gguf
        if self.revision and not Path(where).is_dir():
            kw["revision"] = self.revision
        return kw


def load_config(source: ModelSource) -> Any:
    """Read and check the config alone (no weights): raises for unsupported architectures."""
    where, gguf = source.resolved()
    if gguf:
        _gguf_safe_points()
    try:
        config = AutoConfig.from_pretrained(where, **source.kwargs())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model {source.path_or_id!r}: cannot read its config: {exc}") from exc
    family_for_config(config)
    return config


def _check_safetensors(where: str) -> None:
    path = Path(where)
    if path.is_dir() and not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"model directory {path} has no *.safetensors file (only safetensors are loaded)")


def load_model(source: ModelSource, *, dtype: str = "float32", device: str = "cpu",
               cache: ConvertedCache | None = None) -> PreTrainedModel:
    """The model in `dtype` on `device`. With `cache`, a GGUF source is loaded from its converted
    safetensors copy (made on the first load: models.io.converted); to read its config and tokenizer from
    the copy too, load `cache.converted_source(source, dtype=...)` instead."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if cache is not None:
        source = cache.converted_source(source, dtype=dtype)
    load_config(source)
    where, gguf = source.resolved()
    if not gguf:
        _check_safetensors(where)
    kw = source.kwargs()
    if not gguf:
        kw["use_safetensors"] = True
    else:
        _gguf_safe_points()
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=DTYPES[dtype], **kw)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model {source.path_or_id!r}: cannot load weights: {exc}") from exc
    if gguf:
        # The weights are dequantised: a saved copy is a plain checkpoint, not a GGUF one.
        for attr in ("quantization_config",):
            if hasattr(model.config, attr):
                delattr(model.config, attr)
        model.hf_quantizer = None  # type: ignore[assignment]
    model.to(resolve_device(device))  # type: ignore[arg-type]
    return model.eval()


def _gguf_safe_points() -> None:
    """Make each unit of the GGUF loaders' work a safe point (models.base.progress.check_stop): each metadata
    field and array element gguf's reader reads, each value transformers' loader parses from it and each
    tensor it dequantises (looked up by name when the loaders run), so a stopped job's load ends there
    instead of parsing and dequantising on (a tokenizer's 49,152-string arrays, read twice, then every
    tensor: a minute on 2 loaded cores for the 135M model). Outside a stopped run nothing changes."""
    import gguf
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    for owner, name in ((gguf, "dequantize"), (gguf.GGUFReader, "_get_field_parts"), (hf_gguf, "_gguf_parse_value")):
        _with_safe_point(owner, name)


def _with_safe_point(owner: Any, name: str) -> None:
    """`owner.name` (a function or method) preceded by `check_stop()`; the function it calls is its
    `__wrapped__`. Once per process."""
    original = getattr(owner, name)
    if getattr(original, "checks_stop", False):
        return

    @functools.wraps(original)
    def checked(*args: Any, **kwargs: Any) -> Any:
        check_stop()
        return checked.__wrapped__(*args, **kwargs)

    checked.checks_stop = True  # type: ignore[attr-defined]
    setattr(owner, name, checked)


def load_tokenizer(source: ModelSource) -> Any | None:
    """The model's tokenizer, or None when the checkpoint ships none."""
    where, gguf = source.resolved()
    if gguf:
        _gguf_safe_points()
    try:
        return AutoTokenizer.from_pretrained(where, **source.kwargs())
    except (OSError, ValueError, TypeError):
        return None
    except BaseException as exc:
        # The `tokenizers` library panics on some malformed tokenizer.json files: pyo3's PanicException
        # is a BaseException (not importable by name), which would escape the job's `except Exception`
        # and kill the worker process on every attempt. A ValueError fails the job once, saying why.
        if type(exc).__name__ != "PanicException":
            raise
        raise ModelLoadError(f"model {source.path_or_id!r}: its tokenizer cannot be loaded (PanicException: "
                             f"{str(exc)[:300]})") from None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not re.fullmatch(r"cuda:\d+", device):
        raise ModelLoadError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)
