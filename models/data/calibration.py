"""Calibration and evaluation data: a spec naming a source and how many blocks of how many tokens.

Sources: a text file or a directory of `.txt` files; a `.jsonl` file with a text field; a `.npy` of
token ids (1-D stream or 2-D blocks, no tokenizer needed); `corpus:kjv` / `corpus:shakespeare`
(see `models.io.assets`); `hf:OWNER/NAME[:CONFIG[:SPLIT]]`, a hub dataset streamed with the `datasets`
package (never a builder name or a path of the working directory: `models.io.ids.hf_dataset_refusal`).
Text is tokenised with the model's tokenizer, documents joined by EOS, and packed into blocks.
Blocks are taken from the start of the stream (only as much text is tokenised as needed); the
seed only shuffles their order, so two specs differing in seed see the same tokens.

A data file is someone else's bytes: only what the blocks need is read of it (a .npy is memory-mapped
and only its first blocks touched; text is read in chunks as it is tokenised, a .jsonl line by line
with each line bounded), and the tokenizer runs in a child process under memory and CPU limits
(models.io.sandbox): a tokenizer whose regex panics or never ends on this text fails the job once,
naming the source, instead of killing the worker.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.data.source import DataSource, parse_data_source
from models.io.assets import AssetNotFoundError, corpus_file
from models.io.bounded_json import JsonRefused, load_bounded
from models.io.ids import hf_dataset_refusal
from models.io.sandbox import ChildFailed, TokenizerLimits, run_limited

log = logging.getLogger(__name__)

# Characters tokenised per step: large enough for throughput, small enough to stop early.
_TEXT_CHUNK = 1 << 18
# A .jsonl line (one document) longer than this is refused before it is parsed; nesting past the depth too.
MAX_JSONL_LINE = 64 << 20
MAX_JSONL_DEPTH = 64


_tokenizer_limits = TokenizerLimits()


def set_tokenizer_limits(limits: TokenizerLimits) -> None:
    """The limits of the tokenizer's child process from now on (the worker passes its settings')."""
    global _tokenizer_limits
    _tokenizer_limits = limits


class DataError(ValueError):
    """The data spec or the data it names is unusable."""


# Held-out J of the dtp:1 objective on SmolLM2-135M stops improving (within 1 %) at this many calibration
# tokens (bench/calibration_sweep.py; docs/method.md): the defaults calibrate on at least this many, and a
# run calibrated on fewer says so in its notes (a larger model may need more).
CONVERGED_CALIBRATION_TOKENS = 8_192


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
        try:
            _ = self.data_source  # parsed once, where the spec is read; every reader takes the parsed value
        except ValueError as exc:
            raise DataError(f"source: {exc}") from exc

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    @cached_property  # in the instance's __dict__, not a field: asdict (the fingerprint) stays as it was
    def data_source(self) -> DataSource:
        """`source` parsed (`models.data.source`): which kind of text it names."""
        return parse_data_source(self.source)

    @property
    def tokens_needed(self) -> int:
        return (self.sequences + self.skip_blocks) * self.seq_len


def _file_chunks(path: Path) -> Iterator[str]:
    """A text file's chunks (`_chunks`), read as they are tokenised: never the whole file at once."""
    try:
        with path.open(encoding="utf-8") as handle:
            yield from _chunks(handle.read)
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read as UTF-8 text: {exc}") from exc


def _documents(spec: CalibrationSpec) -> Iterator[Iterator[str]]:
    """The source as a sequence of documents, each a sequence of chunks of text."""
    src = spec.source
    parsed = spec.data_source
    if parsed.kind == "corpus":
        try:
            path = corpus_file(parsed.value)
        except AssetNotFoundError as exc:
            raise DataError(str(exc)) from exc
        yield _file_chunks(path)
        return
    if parsed.kind == "hf":
        for text in _hf_documents(parsed, spec.text_field):
            yield _chunks(io.StringIO(text).read)
        return
    path = Path(src)
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise DataError(f"{path}: directory has no .txt files")
        for f in files:
            yield _file_chunks(f)
        return
    if not path.is_file():
        raise DataError(f"source {src!r}: no such file or directory (expected a .txt/.jsonl/.npy file, "
                        "a directory of .txt files, corpus:NAME or hf:OWNER/NAME[:CONFIG[:SPLIT]])")
    if path.suffix == ".jsonl":
        for text in _jsonl_documents(path, spec.text_field):
            yield _chunks(io.StringIO(text).read)
        return
    yield _file_chunks(path)


def _jsonl_lines(handle: io.TextIOBase, path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of a .jsonl file, each line read with a bound (a 300 MiB line is refused,
    not read into memory)."""
    lineno = 0
    while line := handle.readline(MAX_JSONL_LINE + 1):
        lineno += 1
        if len(line) > MAX_JSONL_LINE:
            raise DataError(f"{path}:{lineno}: a line longer than {MAX_JSONL_LINE} characters (one document of "
                            "a .jsonl file is at most that)")
        yield lineno, line


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    try:
        handle = path.open(encoding="utf-8")
    except OSError as exc:
        raise DataError(f"{path}: cannot open: {exc}") from exc
    with handle:
        for lineno, line in _jsonl_lines(handle, path):
            if not line.strip():
                continue
            try:
                row = load_bounded(line.encode(), name=f"{path}:{lineno}", max_bytes=4 * MAX_JSONL_LINE,
                                   max_depth=MAX_JSONL_DEPTH)
            except JsonRefused as exc:
                raise DataError(str(exc)) from exc
            text = row.get(field) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise DataError(f"{path}:{lineno}: field {field!r} missing or not a string")
            if text:
                yield text


def _hf_documents(source: DataSource, field: str) -> Iterator[str]:
    name, parts = source.value, source.hf_parts
    if not parts[0] or len(parts) > 3:
        raise DataError(f"hf source must be hf:OWNER/NAME[:CONFIG[:SPLIT]], got hf:{name}")
    ds_name, config = parts[0], (parts[1] if len(parts) > 1 and parts[1] else None)
    split = parts[2] if len(parts) > 2 else "train"
    # Checked here, just before the load, whoever checked before: load_dataset would take a builder
    # name or a path of the working directory before the hub (models.io.ids.hf_dataset_refusal).
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


def _chunks(read: Callable[[int], str]) -> Iterator[str]:
    """Text from `read(n)` (a file's, a StringIO's) in chunks of at most _TEXT_CHUNK characters, each
    cut after its last newline when it has one (a line is not split between two tokenizer calls)."""
    buffer = ""
    while True:
        buffer += read(_TEXT_CHUNK + 1 - len(buffer))  # one past a chunk: is there more after it?
        if len(buffer) <= _TEXT_CHUNK:
            if buffer:
                yield buffer
            return
        cut = buffer.rfind("\n", 0, _TEXT_CHUNK)
        end = cut + 1 if cut > 0 else _TEXT_CHUNK
        yield buffer[:end]
        buffer = buffer[end:]


def _tokenise(spec: CalibrationSpec, tokenizer: Any, report: Callable[[str], None]) -> tuple[str, Any]:
    """Tokenise documents until enough tokens for the spec (or the source ends): ("ids", the int64 ids),
    or ("error", a DataError's message). Runs in the tokenizer's child process (`_token_stream`)."""
    report(f"source {spec.source!r}")
    eos = tokenizer.eos_token_id
    pieces: list[np.ndarray] = []
    total, need = 0, spec.tokens_needed
    try:
        for doc in _documents(spec):
            for chunk in doc:
                ids = np.asarray(tokenizer(chunk, add_special_tokens=False)["input_ids"], dtype=np.int64)
                pieces.append(ids)
                total += len(ids)
                if total >= need:
                    return "ids", np.concatenate(pieces)
            if eos is not None:
                pieces.append(np.asarray([eos], dtype=np.int64))
                total += 1
    except DataError as exc:
        return "error", str(exc)
    return "ids", np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def _token_stream(spec: CalibrationSpec, tokenizer: Any) -> np.ndarray:
    """The spec's text tokenised in a child process under the tokenizer limits: a tokenizer that
    panics, runs away or exhausts its memory on this text is a DataError naming the source."""
    if tokenizer is None:
        raise DataError(f"source {spec.source!r} is text, but the model has no tokenizer (use a .npy of ids)")
    try:
        kind, value = run_limited(_tokenise, (spec, tokenizer), limits=_tokenizer_limits.for_tokens(spec.tokens_needed),
                                  what=f"source {spec.source!r}")
    except ChildFailed as exc:
        raise DataError(f"the model's tokenizer failed on {exc} (the tokenizer, its tokenizer.json, or the "
                        "text is at fault; nothing was retried)") from None
    if kind == "error":
        raise DataError(value)
    return np.asarray(value)


def read_token_ids(path: Path, *, label: str, mapped: bool = False) -> np.ndarray:
    """An integer array from a .npy file (never unpickled); a DataError naming `label` otherwise.
    `mapped`: memory-mapped, read from disk only where it is indexed."""
    if not path.is_file():
        raise DataError(f"{label}: no such file")
    try:
        arr = np.load(path, allow_pickle=False, mmap_mode="r" if mapped else None)
    except (OSError, ValueError) as exc:
        raise DataError(f"{label}: cannot read as .npy: {exc}") from exc
    if not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"{label}: token ids must be integers, got dtype {arr.dtype}")
    return arr


def _npy_stream(spec: CalibrationSpec) -> tuple[np.ndarray, int]:
    """(the first tokens_needed ids of the file as int64, the tokens it holds): the file is memory-mapped
    and only those ids are read, whatever its size."""
    path = Path(spec.source)
    arr = read_token_ids(path, label=f"source {spec.source!r}", mapped=True)
    need = spec.tokens_needed
    if arr.ndim == 1:
        return np.array(arr[:need], dtype=np.int64), len(arr)
    if arr.ndim == 2:
        if arr.shape[1] < spec.seq_len:
            raise DataError(f"{path}: 2-D blocks have length {arr.shape[1]} < seq_len={spec.seq_len}")
        rows = arr[: -(-need // spec.seq_len), : spec.seq_len]
        return np.array(rows, dtype=np.int64).reshape(-1), arr.shape[0] * spec.seq_len
    raise DataError(f"{path}: expected a 1-D stream or 2-D blocks of token ids, got {arr.ndim}-D")


def load_blocks(spec: CalibrationSpec, tokenizer: Any = None, vocab_size: int | None = None) -> torch.Tensor:
    """[sequences, seq_len] token ids (int64) for the spec."""
    if spec.source.endswith(".npy"):
        stream, held = _npy_stream(spec)
    else:
        stream = _token_stream(spec, tokenizer)
        held = len(stream)
    available = held // spec.seq_len - spec.skip_blocks
    if available < spec.sequences:
        raise DataError(
            f"source {spec.source!r} has {held} tokens: {max(available, 0)} blocks of {spec.seq_len} "
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
