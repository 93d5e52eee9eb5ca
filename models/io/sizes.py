"""Byte sizes as people write them: `2GiB`, `500MB`, `1.5 GB`, `4096` (bytes), for `--max-memory` and the
job spec's `max_memory`. Decimal units are powers of 1000, binary ones (KiB, MiB, GiB, TiB) of 1024, as
in `huggingface_hub` and `accelerate`'s `max_memory`. Dependency-free: the API validates the field.
"""

from __future__ import annotations

import re

UNITS: dict[str, int] = {
    "": 1, "B": 1,
    "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
    "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4,
}
# What the job spec's `max_memory` and `--max-memory` accept (case-insensitive units).
SIZE_PATTERN = r"^\s*[0-9]+(\.[0-9]+)?\s*([kKmMgGtT][iI]?[bB]|[bB])?\s*$"
_SIZE = re.compile(SIZE_PATTERN)
MIN_SIZE = 1 << 20  # 1 MiB: below it no pass can run, and a typo like `2` (bytes) is refused as such


class SizeError(ValueError):
    """A size that is not a number with an optional unit."""


def parse_size(text: str) -> int:
    """`2GiB` → 2147483648; `500MB` → 500000000. Raises SizeError naming what is accepted."""
    if not isinstance(text, str) or not _SIZE.match(text):
        raise SizeError(f"size must be a number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), "
                        f"e.g. 2GiB or 500MB; got {text!r}")
    number = re.match(r"\s*[0-9.]+", text)
    assert number is not None
    unit = text[number.end():].strip().upper()
    value = int(float(number.group()) * UNITS[unit])
    if value < MIN_SIZE:
        raise SizeError(f"size must be at least 1MiB, got {text!r} ({value} bytes)")
    return value


def format_size(n: float) -> str:
    """Bytes as a short binary-unit text: 1.50 GiB, 300.0 MiB."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if unit in ("TiB", "GiB") else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
