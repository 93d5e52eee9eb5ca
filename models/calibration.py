"""Calibration and evaluation data: a spec naming a source and how many blocks of how many tokens.

Sources: a text file or a directory of `.txt` files; a `.jsonl` file with a text field; a `.npy` of
token ids (1-D stream or 2-D blocks, no tokenizer needed); `corpus:kjv` / `corpus:shakespeare`
(see `models.assets`); `hf:OWNER/NAME[:CONFIG[:SPLIT]]`, a hub dataset streamed with the `datasets`
package (never a builder name or a path of the working directory: `models.ids.hf_dataset_refusal`).
Text is tokenised with the model's tokenizer, documents joined by EOS, and packed into blocks.
Blocks are taken from the start of the stream (only as much text is tokenised as needed); the
seed only shuffles their order, so two specs differing in seed see the same tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.assets import AssetNotFoundError, corpus_file
from models.ids import hf_dataset_refusal

log = logging.getLogger(__name__)

# Characters tokenised per step: large enough for throughput, small enough to stop early.
_TEXT_CHUNK = 1 << 18


class DataError(ValueError):
    """The data spec or the data it names is unusable."""


@dataclass(frozen=True)
class CalibrationSpec:
    source: str
    sequences: int = 64
    seq_len: int = 1024
    seed: int = 0
    text_field: str = "text"
    skip_blocks: int = 0

    def __post_init__(self) -> None:
        if not self.source:
            raise DataError("source: must name a file, a directory, corpus:NAME or hf:OWNER/NAME")
        if self.sequences < 1:
            raise DataError(f"sequences must be ≥ 1, got {self.sequences}")
        if self.seq_len < 2:
            raise DataError(f"seq_len must be ≥ 2, got {self.seq_len}")
        if self.skip_blocks < 0:
            raise DataError(f"skip_blocks must be ≥ 0, got {self.skip_blocks}")

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    @property
    def tokens_needed(self) -> int:
        return (self.sequences + self.skip_blocks) * self.seq_len


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read as UTF-8 text: {exc}") from exc


def _documents(spec: CalibrationSpec) -> Iterator[str]:
    """The source as a sequence of documents (text)."""
    src = spec.source
    if src.startswith("corpus:"):
        try:
            path = corpus_file(src.split(":", 1)[1])
        except AssetNotFoundError as exc:
            raise DataError(str(exc)) from exc
        yield _read_text(path)
        return
    if src.startswith("hf:"):
        yield from _hf_documents(src[3:], spec.text_field)
        return
    path = Path(src)
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise DataError(f"{path}: directory has no .txt files")
        for f in files:
            yield _read_text(f)
        return
    if not path.is_file():
        raise DataError(f"source {src!r}: no such file or directory (expected a .txt/.jsonl/.npy file, "
                        "a directory of .txt files, corpus:NAME or hf:OWNER/NAME[:CONFIG[:SPLIT]])")
    if path.suffix == ".jsonl":
        yield from _jsonl_documents(path, spec.text_field)
        return
    yield _read_text(path)


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    try:
        handle = path.open(encoding="utf-8")
    except OSError as exc:
        raise DataError(f"{path}: cannot open: {exc}") from exc
    with handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON: {exc}") from exc
            text = row.get(field) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise DataError(f"{path}:{lineno}: field {field!r} missing or not a string")
            if text:
                yield text


def _hf_documents(name: str, field: str) -> Iterator[str]:
    parts = name.split(":")
    if not parts[0] or len(parts) > 3:
        raise DataError(f"hf source must be hf:OWNER/NAME[:CONFIG[:SPLIT]], got hf:{name}")
    ds_name, config = parts[0], (parts[1] if len(parts) > 1 and parts[1] else None)
    split = parts[2] if len(parts) > 2 else "train"
    # Checked here, just before the load, whoever checked before: load_dataset would take a builder
    # name or a path of the working directory before the hub (models.ids.hf_dataset_refusal).
    if refusal := hf_dataset_refusal(ds_name):
        raise DataError(refusal)
    try:
        import datasets
    except ImportError as exc:
        raise DataError("hf: sources need the `datasets` package (pip install datasets)") from exc
    # No trust_remote_code: datasets ≥ 4 runs no loading scripts at all, older ones default to False.
    # Streamed: only the rows the blocks need are read. With HF_HUB_OFFLINE=1 the same call reads the
    # local Hugging Face datasets cache (a dataset loaded once before).
    try:
        stream = datasets.load_dataset(ds_name, config, split=split, streaming=True)
    except Exception as exc:  # the hub, the cache and the builders raise many types
        # The message's first line only (bounded): the rest, which can list files, goes to the log.
        log.warning("hf:%s: cannot load dataset %r", name, ds_name, exc_info=True)
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        raise DataError(f"hf:{name}: cannot load dataset {ds_name!r} (config {config}, split {split!r}): "
                        f"{type(exc).__name__}: {first}") from exc
    for row in stream:
        text = row.get(field)
        if not isinstance(text, str):
            raise DataError(f"hf:{name}: rows have no string field {field!r}")
        if text.strip():
            yield text


def _chunks(text: str) -> Iterator[str]:
    start = 0
    while start < len(text):
        end = min(len(text), start + _TEXT_CHUNK)
        if end < len(text):
            cut = text.rfind("\n", start, end)
            end = cut + 1 if cut > start else end
        yield text[start:end]
        start = end


def _token_stream(spec: CalibrationSpec, tokenizer: Any) -> np.ndarray:
    """Tokenise documents until enough tokens for the spec (or the source ends)."""
    if tokenizer is None:
        raise DataError(f"source {spec.source!r} is text, but the model has no tokenizer (use a .npy of ids)")
    eos = tokenizer.eos_token_id
    pieces: list[np.ndarray] = []
    total, need = 0, spec.tokens_needed
    for doc in _documents(spec):
        for chunk in _chunks(doc):
            ids = np.asarray(tokenizer(chunk, add_special_tokens=False)["input_ids"], dtype=np.int64)
            pieces.append(ids)
            total += len(ids)
            if total >= need:
                return np.concatenate(pieces)
        if eos is not None:
            pieces.append(np.asarray([eos], dtype=np.int64))
            total += 1
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def read_token_ids(path: Path, *, label: str) -> np.ndarray:
    """An integer array from a .npy file (never unpickled); a DataError naming `label` otherwise."""
    if not path.is_file():
        raise DataError(f"{label}: no such file")
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"{label}: cannot read as .npy: {exc}") from exc
    if not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"{label}: token ids must be integers, got dtype {arr.dtype}")
    return arr


def _npy_blocks(spec: CalibrationSpec) -> np.ndarray:
    path = Path(spec.source)
    arr = read_token_ids(path, label=f"source {spec.source!r}")
    if arr.ndim == 1:
        return arr.astype(np.int64)
    if arr.ndim == 2:
        if arr.shape[1] < spec.seq_len:
            raise DataError(f"{path}: 2-D blocks have length {arr.shape[1]} < seq_len={spec.seq_len}")
        return arr[:, : spec.seq_len].astype(np.int64).reshape(-1)
    raise DataError(f"{path}: expected a 1-D stream or 2-D blocks of token ids, got {arr.ndim}-D")


def load_blocks(spec: CalibrationSpec, tokenizer: Any = None, vocab_size: int | None = None) -> torch.Tensor:
    """[sequences, seq_len] token ids (int64) for the spec."""
    stream = _npy_blocks(spec) if spec.source.endswith(".npy") else _token_stream(spec, tokenizer)
    available = len(stream) // spec.seq_len - spec.skip_blocks
    if available < spec.sequences:
        raise DataError(
            f"source {spec.source!r} has {len(stream)} tokens: {max(available, 0)} blocks of {spec.seq_len} "
            f"after skipping {spec.skip_blocks}, but {spec.sequences} are needed; lower sequences/seq_len "
            "or give more data"
        )
    start = spec.skip_blocks * spec.seq_len
    blocks = stream[start : start + spec.sequences * spec.seq_len].reshape(spec.sequences, spec.seq_len)
    if vocab_size is not None and (blocks.min() < 0 or blocks.max() >= vocab_size):
        raise DataError(
            f"source {spec.source!r}: token ids must be in [0, {vocab_size - 1}] (the model's vocabulary), "
            f"found {int(blocks.min())}..{int(blocks.max())}"
        )
    order = np.random.default_rng(spec.seed).permutation(spec.sequences)
    return torch.from_numpy(np.ascontiguousarray(blocks[order]))
