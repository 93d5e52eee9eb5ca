"""A GGUF file's header (metadata and tensor table), read with bounds: every count and length is checked
against the bytes the file still holds and against explicit limits before anything is read or looped
over, so a 49-byte file declaring a 2^62-element array is refused at once instead of read element by
element. Standard library only: the API reads tenants' GGUF uploads with it.

    header = read_header(buffer, limits=GGUFLimits())      # a bytes-like of the file's start
    config = header.config()                               # the architecture fields, as config.json has them

The layout (ggml's docs/gguf.md, versions 2 and 3): magic `GGUF`, version (u32), tensor count (u64),
metadata count (u64); each metadata entry a string key, a value type (u32) and the value; then each
tensor's name, dimension count (u32), dimensions (u64 each), type (u32) and data offset (u64). Strings are
a u64 length and that many bytes. Arrays are an element type (u32), a count (u64) and the elements: an
array of fixed-size elements is skipped in one step (its size is count × element size); only arrays
of strings are walked, at most `max_array_items` of them, and all arrays together hold at most
`max_metadata_items` elements (transformers' GGUF loader makes a Python object of every element: ~40 µs
and ~1.6 KiB each, measured in docs/security.md). Each tensor's entry is kept (name, dimensions, type,
offset) for models.io.gguf_tensors to check against the config. Integers are little-endian, or big-endian
when the version reads byte-swapped (as gguf-py detects it).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 8  # ggml has 4; anything past a handful is not a tensor a model holds

# Value types: (struct code, size) of the fixed-size ones; 8 is a string, 9 an array.
_FIXED = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4),
          7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
STRING, ARRAY = 8, 9

# What a config is made of (config.json's name → the GGUF key after `<architecture>.`).
CONFIG_KEYS = {
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "intermediate_size": "feed_forward_length",
    "hidden_size": "embedding_length",
    "head_dim": "attention.key_length",
    "max_position_embeddings": "context_length",
    "vocab_size": "vocab_size",
}


class GGUFError(ValueError):
    """The file is not a GGUF file this server reads: truncated, malformed, or past a limit."""


@dataclass(frozen=True)
class GGUFLimits:
    """The most a header may hold (the settings GGUF_MAX_METADATA_BYTES etc.; real models are far below each)."""

    max_metadata_bytes: int = 64 << 20  # the header (metadata and tensor table) as a whole
    max_array_items: int = 1 << 21  # elements of one array (a vocabulary of 262,144 tokens is 2^18)
    max_entries: int = 1 << 12  # metadata entries (real files: a few dozen)
    max_tensors: int = 1 << 16  # tensors (real files: hundreds to a few thousand)
    # elements of all arrays together (Gemma 3: 3 × 262,144; Llama 3: 3 × 128,256 + 280,147 merges)
    max_metadata_items: int = 1 << 20


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor table: its dimensions in ggml's order (the fastest-varying first, the
    reverse of torch's shape), its ggml type id, and its data's offset from the start of the data section."""

    name: str
    dims: tuple[int, ...]
    type: int
    offset: int


@dataclass
class GGUFHeader:
    """What the header holds: scalar metadata by key, array metadata by key as (element type, count),
    the tensor count, and the header's length in bytes."""

    version: int
    tensor_count: int
    scalars: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, tuple[int, int]] = field(default_factory=dict)
    tensors: list[GGUFTensor] = field(default_factory=list)
    header_bytes: int = 0

    @property
    def data_start(self) -> int:
        """Where the tensor data starts: the header's end rounded up to `general.alignment` (default 32)."""
        align = self.scalars.get("general.alignment", 32)
        if not isinstance(align, int) or isinstance(align, bool) or not 1 <= align <= 1 << 16 or align & (align - 1):
            raise GGUFError(f"general.alignment is {align!r}; a power of two up to 65536 is read")
        return -(-self.header_bytes // align) * align

    def config(self) -> dict[str, Any]:
        """The architecture fields under their config.json names (only those the file states); without
        `<arch>.vocab_size`, vocab_size is the length of its token list (as transformers reads it)."""
        arch = self.scalars.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise GGUFError("its metadata has no general.architecture")
        config: dict[str, Any] = {"model_type": arch}
        for name, suffix in CONFIG_KEYS.items():
            value = self.scalars.get(f"{arch}.{suffix}")
            if isinstance(value, int) and not isinstance(value, bool):
                config[name] = value
        if "vocab_size" not in config and "tokenizer.ggml.tokens" in self.arrays:
            config["vocab_size"] = self.arrays["tokenizer.ggml.tokens"][1]
        return config


class _Cursor:
    """Reads forward through `data`, each read checked against what is left of it."""

    def __init__(self, data: bytes | memoryview, *, file_size: int, limits: GGUFLimits, endian: str) -> None:
        self.data, self.pos, self.file_size, self.limits, self.endian = memoryview(data), 0, file_size, limits, endian
        self.items_left = limits.max_metadata_items  # array elements all arrays may still hold

    def take(self, size: int, what: str) -> memoryview:
        if size > len(self.data) - self.pos:
            if self.pos + size > self.file_size:
                raise GGUFError(f"{what} at byte {self.pos} declares {size} bytes; the file holds "
                                f"{max(0, self.file_size - self.pos)} more")
            raise GGUFError(f"its header is longer than {self.limits.max_metadata_bytes} bytes "
                            "(DTP_LAYOUT_GGUF_MAX_METADATA_BYTES)")
        out = self.data[self.pos:self.pos + size]
        self.pos += size
        return out

    def number(self, code: str, what: str) -> Any:
        size = struct.calcsize(code)
        return struct.unpack(self.endian + code, self.take(size, what))[0]

    def string(self, what: str) -> str:
        length = self.number("Q", what)
        raw = self.take(length, what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{what} at byte {self.pos - length} is not UTF-8") from None


def _value(cur: _Cursor, kind: int, key: str) -> Any:
    if kind in _FIXED:
        return cur.number(_FIXED[kind][0], f"the value of {key!r}")
    if kind == STRING:
        return cur.string(f"the string value of {key!r}")
    raise GGUFError(f"metadata {key!r} has value type {kind}, which GGUF does not define")


def _array(cur: _Cursor, key: str) -> tuple[int, int]:
    """Skip an array, checking its count first; (element type, count)."""
    kind = cur.number("I", f"the element type of {key!r}")
    count = cur.number("Q", f"the length of {key!r}")
    if count > cur.limits.max_array_items:
        raise GGUFError(f"metadata array {key!r} declares {count} elements; this server reads at most "
                        f"{cur.limits.max_array_items} (DTP_LAYOUT_GGUF_MAX_ARRAY_ITEMS)")
    if count > cur.items_left:
        raise GGUFError(f"metadata array {key!r} declares {count} elements, past the "
                        f"{cur.limits.max_metadata_items} all its metadata arrays together may hold "
                        f"({cur.limits.max_metadata_items - cur.items_left} before it; "
                        "DTP_LAYOUT_GGUF_MAX_METADATA_ITEMS)")
    cur.items_left -= count
    if kind in _FIXED:
        cur.take(count * _FIXED[kind][1], f"array {key!r} ({count} elements)")
    elif kind == STRING:
        _skip_strings(cur, count, key)
    else:  # arrays of arrays: legal GGUF, but no model's metadata needs one
        raise GGUFError(f"metadata array {key!r} has element type {kind}; this server reads arrays of numbers "
                        "and strings")
    return kind, count


def _skip_strings(cur: _Cursor, count: int, key: str) -> None:
    """Step over `count` strings: one bounds check per string and no copies (2^21 of them in under a
    second). A string past the end raises through `take`, which says whether the file ended or the
    header limit was reached."""
    length_at = struct.Struct(cur.endian + "Q").unpack_from
    data, pos, end = cur.data, cur.pos, len(cur.data)
    for i in range(count):
        if pos + 8 > end:
            cur.pos = pos
            cur.take(8, f"the length of element {i} of {key!r}")
        length = length_at(data, pos)[0]
        if pos + 8 + length > end:
            cur.pos = pos + 8
            cur.take(length, f"element {i} of {key!r}")
        pos += 8 + length
    cur.pos = pos


def _endianness(head: bytes | memoryview) -> str:
    if len(head) < 24 or bytes(head[:4]) != MAGIC:
        raise GGUFError("it does not start with the GGUF magic and a 24-byte header")
    little = struct.unpack("<I", head[4:8])[0]
    if little in VERSIONS:
        return "<"
    if struct.unpack(">I", head[4:8])[0] in VERSIONS:
        return ">"
    raise GGUFError(f"GGUF version {little} is not one this server reads ({', '.join(map(str, VERSIONS))})")


def read_header(data: bytes | memoryview, *, file_size: int | None = None,
                limits: GGUFLimits | None = None) -> GGUFHeader:
    """Parse the header from `data`, the file's first bytes (at most limits.max_metadata_bytes of it
    are looked at); `file_size` (default len(data)) tells a truncated file from a header past the
    limit. Raises GGUFError saying what is wrong and where."""
    limits = limits or GGUFLimits()
    view = memoryview(data)[:limits.max_metadata_bytes]
    cur = _Cursor(view, file_size=len(data) if file_size is None else file_size, limits=limits,
                  endian=_endianness(view))
    cur.pos = 8
    tensors, entries = cur.number("Q", "the tensor count"), cur.number("Q", "the metadata count")
    if tensors > limits.max_tensors:
        raise GGUFError(f"it declares {tensors} tensors; this server reads at most {limits.max_tensors} "
                        "(DTP_LAYOUT_GGUF_MAX_TENSORS)")
    if entries > limits.max_entries:
        raise GGUFError(f"it declares {entries} metadata entries; this server reads at most {limits.max_entries} "
                        "(DTP_LAYOUT_GGUF_MAX_ENTRIES)")
    header = GGUFHeader(version=struct.unpack(cur.endian + "I", view[4:8])[0], tensor_count=tensors)
    for i in range(entries):
        key = cur.string(f"the key of metadata entry {i}")
        kind = cur.number("I", f"the value type of {key!r}")
        if kind == ARRAY:
            header.arrays[key] = _array(cur, key)
        else:
            header.scalars[key] = _value(cur, kind, key)
    for i in range(tensors):
        name = cur.string(f"the name of tensor {i}")
        dims = cur.number("I", f"the dimension count of tensor {name!r}")
        if not 1 <= dims <= MAX_DIMS:
            raise GGUFError(f"tensor {name[:100]!r} declares {dims} dimensions (1 to {MAX_DIMS} are read)")
        raw = cur.take(8 * dims + 4 + 8, f"the shape, type and offset of tensor {name[:100]!r}")
        *shape, kind, offset = struct.unpack(f"{cur.endian}{dims}QIQ", raw)
        header.tensors.append(GGUFTensor(name=name, dims=tuple(shape), type=kind, offset=offset))
    header.header_bytes = cur.pos
    return header
