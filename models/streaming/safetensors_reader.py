"""Writing a safetensors file tensor by tensor: the header (every tensor's name, dtype, shape and byte
range) is known from the shapes before any weight is read, so it is written first and each tensor's
bytes are appended as it is made; nothing holds more than one tensor. The file is the safetensors
format as `safetensors.torch.save_file` writes it (8-byte little-endian header length, a JSON header
padded with spaces to 8 bytes, the data), read back by `safe_open` and `load_file` like any other.
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


class SafetensorsWriter:
    """One safetensors file whose tensors (name, dtype, shape) are declared up front and written in order."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        self._expected: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
        for name, dtype, shape in entries:
            nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self._expected.append((name, dtype, tuple(shape), nbytes))
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as save_file pads it
        self._file: BinaryIO = open(self.path, "wb")  # noqa: SIM115 (closed by close())
        self._file.write(len(text).to_bytes(8, "little"))
        self._file.write(text)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected, dtype, shape, nbytes = self._expected[self._next]
        if name != expected or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{self.path.name}: expected {expected} {dtype} {list(shape)}, got {name} "
                             f"{tensor.dtype} {list(tensor.shape)}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        assert data.numel() == nbytes
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
