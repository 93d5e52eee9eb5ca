"""Atomic file writes: a reader sees the old file or the whole new one, never half of either.

The data goes to a uniquely named hidden sibling (same directory, so the same filesystem), which
`os.replace` then renames over the target; on any failure the sibling is removed and the target is
untouched. Concurrent writers never share a temporary file. Torch-free.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any


def temporary_sibling(path: Path, tag: str = "tmp") -> Path:
    """A hidden, unique name next to `path`: `.NAME.TAG-xxxxxxxx`."""
    return path.with_name(f".{path.name}.{tag}-{uuid.uuid4().hex[:8]}")


def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> Path:
    """Call write(tmp) to produce the file at a temporary sibling, then rename it over `path`.

    `write` may be any writer that takes a path (torch.save, safetensors' save_file, Path.write_text).
    The parent directory is created if missing. Returns `path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, doc: Any, *, indent: int | None = 1) -> Path:
    return atomic_write_text(path, json.dumps(doc, indent=indent))
