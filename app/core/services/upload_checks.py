"""What a completed upload's files hold, read as hostile input: each reader bounded by the file's own
size and by the settings' limits, and all of them run in a child process (models.io.sandbox) under an
address-space limit, a CPU-time limit and a wall-clock timeout, so no file can hang, grow or crash the
API process. Every refusal is a SpecError naming the file and the rule (a 422); the caller removes
the refused upload.

    config = check_contents(settings=settings, kind="model", prefix=prefix, names=names)

A model upload: config.json (1 MiB, JSON_MAX_DEPTH, finite numbers) under the server's limits for its
family; each .safetensors header (SAFETENSORS_MAX_HEADER_BYTES, refused before it is read; a JSON
object of tensors whose byte ranges lie inside the file); every other JSON file (JSON_MAX_BYTES,
depth, finite numbers); tokenizer.json loaded by the `tokenizers` library, where the server has it,
and run over probe text that trips runaway regexes; every other tokenizer file within its kind's cap
(SIDE_FILE_CAPS below: the worker's slow tokenizers hold ~28× it); or a .gguf file's
header (models.io.gguf_header, the GGUF_* limits) and its tensor table against its config
(models.io.gguf_tensors: no tensor the loader would dequantise and drop). A data upload: a .npy's
header (integers, 1-D or 2-D, never objects). Text is not read here: the worker reads only the tokens
a job needs.
"""

from __future__ import annotations

import io
import math
import multiprocessing
import os
import struct
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from app.core.errors import SpecError, StoreUnreachable
from app.core.services.model_limits import upload_config_problems
from app.core.services.sources import MAX_CONFIG_BYTES
from app.core.settings import Settings
from app.core.storage.root import Storage, StoreUnavailable
from app.core.storage.uploads import UploadStore
from models.io.bounded_json import JsonRefused, load_bounded, load_object
from models.io.gguf_header import GGUFError, read_header
from models.io.gguf_tensors import check_tensor_table
from models.io.sandbox import ChildFailed, ChildLimits, run_limited

# JSON files a model upload may hold that are configs (small) rather than vocabularies.
CONFIG_FILES = frozenset({"config.json", "generation_config.json"})
# safetensors' dtype names (the format's Dtype enum, safetensors 0.8): what a header's `dtype` may say.
SAFETENSORS_DTYPES = frozenset({"BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
                                "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64",
                                "F64", "I64", "U64"})
NPY_HEAD = 1 << 16  # a .npy header is at most this long (numpy writes under 4 KiB; it refuses > 10,000)
# Text the tokenizer must get through: runs of one character end a catastrophic regex like `(a|aa)+$`.
PROBE_TEXT = ("The quick brown fox jumps over the lazy dog. 0123456789 \n"
              + "a" * 4096 + "!\n" + " " * 4096 + "\n" + "ab" * 2048 + "?\n")
Report = Callable[[str], None]


# ---- the tokenizer's side files ----
# The tokenizer's side files of a model upload, each kind with its own size cap, checked at completion
# before a byte of them is read: every file the worker's `AutoTokenizer` may parse is one of these or
# tokenizer.json (JSON_MAX_BYTES, loaded by `tokenizers` in the check), so none reaches the worker larger
# than its kind's cap.
#
# Why per kind (issue 41): a tokenizer_config.json naming a slow class (GPT2Tokenizer, BertTokenizer, a
# sentencepiece one) makes transformers build the tokenizer in Python from vocab.json + merges.txt,
# vocab.txt or tokenizer.model, holding ~28× the file in memory (an 80 MB merges.txt took the worker
# 495 → 2,681 MB). The caps are ~5× the largest real file of each kind (docs/security.md):
#
#     vocabulary (vocab.json, merges.txt, vocab.txt, added_tokens.json)   TOKENIZER_VOCAB_MAX_BYTES (8 MiB)
#     sentencepiece model (tokenizer.model)                              TOKENIZER_MODEL_MAX_BYTES (8 MiB)
#     configuration (tokenizer_config.json, special_tokens_map.json,
#                    chat_template.json, chat_template.jinja)           TOKENIZER_CONFIG_MAX_BYTES (4 MiB)
#
# The text kinds (merges.txt, vocab.txt, chat_template.jinja) are read whole in the check and must be
# UTF-8; the JSON kinds go through the bounded JSON reader like every other JSON file.

# file name → the settings field capping it
SIDE_FILE_CAPS = {
    "vocab.json": "tokenizer_vocab_max_bytes", "merges.txt": "tokenizer_vocab_max_bytes",
    "vocab.txt": "tokenizer_vocab_max_bytes", "added_tokens.json": "tokenizer_vocab_max_bytes",
    "tokenizer.model": "tokenizer_model_max_bytes",
    "tokenizer_config.json": "tokenizer_config_max_bytes", "special_tokens_map.json": "tokenizer_config_max_bytes",
    "chat_template.json": "tokenizer_config_max_bytes", "chat_template.jinja": "tokenizer_config_max_bytes",
}
TEXT_FILES = frozenset({"merges.txt", "vocab.txt", "chat_template.jinja"})


def side_file_cap(settings: Settings, name: str) -> tuple[int, str] | None:
    """(bytes, variable) capping the side file `name`, or None when it is not a tokenizer side file."""
    field = SIDE_FILE_CAPS.get(name)
    return None if field is None else (getattr(settings, field), f"DTP_LAYOUT_{field.upper()}")


def size_problem(settings: Settings, name: str, size: int) -> str | None:
    """Why a side file of `size` bytes is refused (before it is read), or None."""
    cap = side_file_cap(settings, name)
    if cap is None or size <= cap[0]:
        return None
    return (f"is {size} bytes; a tokenizer's {name} is at most {cap[0]} bytes on this server ({cap[1]}): the "
            "worker would hold many times it in memory")


def text_problem(raw: bytes) -> str | None:
    """Why a text side file is not one the tokenizer reads, or None."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"is not UTF-8 text (byte {exc.start})"
    return None


def _problem(name: str, rule: str) -> SpecError:
    return SpecError([("files", f"{name!r}: {rule}")])


def _read(store: UploadStore, prefix: str, name: str, limit: int) -> bytes:
    return store.read_head(store.file_key(prefix, name), limit)


def _json(store: UploadStore, prefix: str, name: str, *, max_bytes: int, depth: int) -> Any:
    raw = _read(store, prefix, name, max_bytes + 1)
    try:
        return load_bounded(raw, name=name, max_bytes=max_bytes, max_depth=depth)
    except JsonRefused as exc:
        raise _problem(name, exc.rule) from None


def check_safetensors(store: UploadStore, prefix: str, name: str, settings: Settings) -> None:
    """The header's length within the limit before a byte of it is read, then a bounded JSON object
    whose tensors' byte ranges lie inside the file."""
    info = store.objects.head(store.file_key(prefix, name))
    size = info.size if info is not None else 0
    head = _read(store, prefix, name, 8)
    if len(head) < 8:
        raise _problem(name, "is not a safetensors file (shorter than its 8-byte header length)")
    (length,) = struct.unpack("<Q", head)
    limit = settings.safetensors_max_header_bytes
    if length > limit:
        raise _problem(name, f"is not a safetensors file this server reads: it declares a {length}-byte header; "
                             f"headers are at most {limit} bytes (DTP_LAYOUT_SAFETENSORS_MAX_HEADER_BYTES)")
    if not 2 <= length <= size - 8:
        raise _problem(name, f"is not a safetensors file (header length {length}, file {size} bytes)")
    raw = _read(store, prefix, name, 8 + length)[8:]
    try:
        header = load_object(raw, name=name, max_bytes=limit, max_depth=settings.json_max_depth)
    except JsonRefused as exc:
        raise _problem(name, f"is not a safetensors file: its header {exc.rule}") from None
    data = size - 8 - length
    for tensor, entry in header.items():
        if tensor == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data):
            raise _problem(name, f"tensor {str(tensor)[:100]!r} has no byte range inside the file's {data} bytes "
                                 "of data")
        dtype = entry.get("dtype")
        if dtype not in SAFETENSORS_DTYPES:  # its text would reach the job's error (issue 41): a known name only
            shown = repr(dtype)[:40] if isinstance(dtype, str) else type(dtype).__name__
            raise _problem(name, f"tensor {str(tensor)[:100]!r} has dtype {shown}; a safetensors dtype is one of "
                                 f"{', '.join(sorted(SAFETENSORS_DTYPES))}")


def check_tokenizer(raw: bytes, name: str) -> None:
    """The `tokenizers` library loads it and tokenises the probe text (where the server has the
    library; the worker's own tokenizer runs in a limited child regardless)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return
    tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    tokenizer.encode(PROBE_TEXT)


def check_side_file(store: UploadStore, prefix: str, name: str, settings: Settings) -> None:
    """A tokenizer side file within its kind's cap, refused before it is read; a text one UTF-8
    (SIDE_FILE_CAPS)."""
    cap = side_file_cap(settings, name)
    if cap is None:
        return
    info = store.objects.head(store.file_key(prefix, name))
    if problem := size_problem(settings, name, info.size if info is not None else 0):
        raise _problem(name, problem)
    if name in TEXT_FILES and (problem := text_problem(_read(store, prefix, name, cap[0]))):
        raise _problem(name, problem)


def check_model(store: UploadStore, prefix: str, names: list[str], settings: Settings,
                report: Report) -> dict[str, Any]:
    config: Any = None
    for name in names:
        if name.endswith(".safetensors"):
            report(name)
            check_safetensors(store, prefix, name, settings)
    if names[0].endswith(".gguf"):
        return gguf_config(store, prefix, names[0], settings, report)
    for name in names:
        check_side_file(store, prefix, name, settings)
    for name in names:
        if name.endswith(".json"):
            report(name)
            cap = side_file_cap(settings, name)
            limit = MAX_CONFIG_BYTES if name in CONFIG_FILES else cap[0] if cap else settings.json_max_bytes
            value = _json(store, prefix, name, max_bytes=limit, depth=settings.json_max_depth)
            if name == "tokenizer.json":
                check_tokenizer(_read(store, prefix, name, limit), name)
            if name == "config.json":
                config = value
    report("config.json")
    if not isinstance(config, dict):
        raise _problem("config.json", "is not a JSON object")
    return config


def gguf_config(store: UploadStore, prefix: str, name: str, settings: Settings, report: Report) -> dict[str, Any]:
    """The architecture fields of the GGUF header, once its tensor table agrees with them (names, shapes,
    types and byte ranges: models.io.gguf_tensors): no more of the file read than its header."""
    report(name)
    limits = settings.gguf_limits()
    info = store.objects.head(store.file_key(prefix, name))
    size = info.size if info is not None else 0
    try:
        header = read_header(_read(store, prefix, name, limits.max_metadata_bytes), file_size=size, limits=limits)
        config = header.config()
        if problems := upload_config_problems(config, settings=settings):  # said before the tensors' names
            raise SpecError([("files", f"the model's config is refused: {message}") for _field, message in problems])
        check_tensor_table(header, config, file_size=size)
    except GGUFError as exc:
        raise _problem(name, f"cannot read its GGUF header: {exc}") from None
    return config


def check_npy(head: bytes, name: str) -> None:
    import numpy as np

    f = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(f)
        shape, _order, dtype = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                                else np.lib.format.read_array_header_2_0(f))
    except (ValueError, OSError, SyntaxError) as exc:
        raise _problem(name, f"is not a .npy file: {str(exc)[:200]}") from None
    if dtype.hasobject or dtype.kind not in "iu" or len(shape) not in (1, 2):
        raise _problem(name, f"holds {dtype} of shape {shape}; a data upload's .npy holds integer token ids, 1-D "
                             "or 2-D (never objects: they would need unpickling)")


def stored_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config's scalar fields, as the upload row keeps them: what every database's JSON column
    takes (finite numbers, 64-bit integers, strings without NUL, bounded)."""
    def storable(value: Any) -> bool:
        if isinstance(value, bool | str):
            return not isinstance(value, str) or (len(value) <= 1000 and "\x00" not in value)
        if isinstance(value, int):
            return -(1 << 63) <= value < 1 << 63
        return isinstance(value, float) and math.isfinite(value)

    return {k: v for k, v in config.items() if len(str(k)) <= 100 and "\x00" not in k and storable(v)}


def content_check(*, settings: Settings, store: UploadStore, kind: str, prefix: str, names: list[str],
                  report: Report = lambda _name: None) -> dict[str, Any] | None:
    """In this process: what a file's name cannot tell (module docstring). Returns a model's config as
    stored; raises SpecError naming the file."""
    if kind == "data":
        for name in names:
            if name.endswith(".npy"):
                report(name)
                check_npy(_read(store, prefix, name, NPY_HEAD), name)
        return None
    config = check_model(store, prefix, names, settings, report)
    if problems := upload_config_problems(config, settings=settings):
        raise SpecError([("files", f"the model's config is refused: {message}") for _field, message in problems])
    return stored_config(config)


def _in_child(settings: Settings, store_env: dict[str, str], kind: str, prefix: str, names: list[str],
              report: Report) -> tuple[str, Any]:
    """The child's side: ("ok", config), ("refused", problems) or ("unavailable", message) — plain
    values that pickle (an exception's class might not). `store_env`: the caller's AWS_* variables (the
    fork server's environment is the one it started with)."""
    os.environ.update(store_env)
    store = UploadStore(Storage.from_settings(settings))
    try:
        return "ok", content_check(settings=settings, store=store, kind=kind, prefix=prefix, names=names,
                                   report=report)
    except SpecError as exc:
        return "refused", exc.problems
    except StoreUnavailable as exc:
        return "unavailable", str(exc)


_preloaded = False


def _preload() -> None:
    """The fork server imports this module once; each check's child is a fork of it (milliseconds),
    not a new interpreter importing the service again (a second or two on a busy machine)."""
    global _preloaded
    if not _preloaded:
        multiprocessing.set_forkserver_preload([__name__])
        _preloaded = True


def start_checker() -> None:
    """Start the fork server now (the API's startup, in the background), so that the first completion
    does not wait for its imports."""
    from multiprocessing import forkserver

    _preload()
    forkserver.ensure_running()


def bytes_checked(settings: Settings, name: str, size: int) -> int:
    """At most how many of a file's `size` bytes the check reads: a header up to its limit, the rest whole."""
    if name.endswith(".safetensors"):
        return min(size, 8 + settings.safetensors_max_header_bytes)
    if name.endswith(".gguf"):
        return min(size, settings.gguf_limits().max_metadata_bytes)
    if name.endswith(".npy"):
        return min(size, NPY_HEAD)
    return size


def check_limits(settings: Settings, names: list[str], sizes: list[int]) -> ChildLimits:
    """The upload-check limits with a CPU budget scaled by what the check reads (issue 41: a 5 KB
    tokenizer.json whose regex backtracks spent 45 of a flat 60 CPU-s, holding a slot all the while):
    UPLOAD_CHECK_CPU_S_BASE + UPLOAD_CHECK_CPU_S_PER_MIB per MiB read, at most UPLOAD_CHECK_CPU_S. CPU
    time, not wall clock: a loaded machine slows a check without cutting it."""
    read = sum(bytes_checked(settings, name, size) for name, size in zip(names, sizes, strict=True))
    cpu = settings.upload_check_cpu_s_base + int(settings.upload_check_cpu_s_per_mib * read / (1 << 20))
    return replace(settings.upload_check_limits(), cpu_s=min(cpu, settings.upload_check_cpu_s),
                   cpu_setting="DTP_LAYOUT_UPLOAD_CHECK_CPU_S_BASE + DTP_LAYOUT_UPLOAD_CHECK_CPU_S_PER_MIB per MiB "
                               "read, at most DTP_LAYOUT_UPLOAD_CHECK_CPU_S")


def check_contents(*, settings: Settings, kind: str, prefix: str, names: list[str],
                   sizes: list[int]) -> dict[str, Any] | None:
    """`content_check` in a child process under the upload-check limits (the settings
    UPLOAD_CHECK_MEMORY_BYTES, the CPU budget of `check_limits` for files of `sizes` bytes,
    UPLOAD_CHECK_TIMEOUT_S). SpecError (422) for a refused file, or for one whose reading crashed,
    panicked or passed a limit; StoreUnreachable (503) when the store could not be read."""
    _preload()
    try:
        store_env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
        outcome, value = run_limited(_in_child, (settings, store_env, kind, prefix, names),
                                     limits=check_limits(settings, names, sizes), what=names[0],
                                     start_method="forkserver")
    except ChildFailed as exc:
        raise SpecError([("files", str(exc))]) from None
    if outcome == "refused":
        raise SpecError([tuple(problem) for problem in value])
    if outcome == "unavailable":  # not the tenant's fault: the upload stays open, to complete again
        raise StoreUnreachable(f"the object store did not answer while the upload was checked ({value[:200]}); "
                               "complete it again", field="upload_id", headers={"Retry-After": "5"})
    return value
