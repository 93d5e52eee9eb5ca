"""Writing a safetensors file tensor by tensor: the header (every tensor's name, dtype, shape and byte
range) is known from the shapes before any weight is read, so it is written first and each tensor's
bytes are written at its place as it is made; nothing holds more than one tensor. The file is byte for
byte what `safetensors.torch.save_file` writes for the same tensors and metadata (8-byte little-endian
header length, a JSON header padded with spaces to 8 bytes, the data in save_file's order: by dtype,
widest first, then by name), whatever order the tensors are declared and written in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import BinaryIO

import torch

# safetensors' dtype names (safetensors.torch._TYPES)
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
# safetensors' Dtype enum order, which save_file sorts by (descending) before the names
_DTYPE_RANK = {name: k for k, name in enumerate(("BOOL", "U8", "I8", "I16", "F16", "BF16", "I32", "F32", "F64",
                                                 "I64"))}


class SafetensorsWriter:
    """One safetensors file whose tensors (name, dtype, shape) are declared up front and written in that order."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
        stored = sorted(entries, key=lambda e: (-_DTYPE_RANK[DTYPE_NAMES[e[1]]], e[0]))  # save_file's order
        offset = 0
        offsets: dict[str, int] = {}
        for name, dtype, shape in stored:
            nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offsets[name] = offset
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as save_file pads it
        self._data_start = 8 + len(text)
        self._expected = [(name, dtype, tuple(shape), offsets[name]) for name, dtype, shape in entries]
        self._file: BinaryIO = open(self.path, "wb")  # noqa: SIM115 (closed by close())
        self._file.write(len(text).to_bytes(8, "little"))
        self._file.write(text)
        self._file.truncate(self._data_start + offset)  # the whole file's length: each tensor lands in place
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected, dtype, shape, offset = self._expected[self._next]
        if name != expected or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{self.path.name}: expected {expected} {dtype} {list(shape)}, got {name} "
                             f"{tensor.dtype} {list(tensor.shape)}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        self._file.seek(self._data_start + offset)
        self._file.write(data.numpy().data)  # the tensor's own bytes, not a copy
        self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self._expected):
            raise ValueError(f"{self.path.name}: {len(self._expected) - self._next} tensors not written")

    def abort(self) -> None:
        self._file.close()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
