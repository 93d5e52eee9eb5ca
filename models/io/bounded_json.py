"""JSON from someone else's file, parsed with bounds: its size, its nesting depth, and no `NaN` or
`Infinity` (which are not JSON, and which a database's JSON column refuses after the file was accepted).

    config = load_bounded(raw, name="config.json", max_bytes=1 << 20, max_depth=64)

The depth is measured before the parser sees the text: Python's parser recurses once per level, so a
100,000-deep nest would be a RecursionError (and its stack) instead of a refusal. Measuring is a few
vectorised passes over the bytes (which quotes are escaped, which brackets are inside strings, a
cumulative sum), linear in the size whatever the bytes are. Dependency-light: the API reads tenants'
files with it (numpy only).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

_CHUNK = 1 << 20  # bytes measured at once: bounded scratch memory, whatever the file's size
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


class JsonRefused(ValueError):
    """A tenant's JSON file broke a rule; `name` is the file, `rule` the rule it broke (for a 422)."""

    def __init__(self, name: str, rule: str) -> None:
        super().__init__(f"{name}: {rule}")
        self.name, self.rule = name, rule


def nesting_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in `raw` (0 for a scalar); brackets inside strings do
    not count. Exact up to the first byte a parser would refuse (outside a string, JSON has no
    backslash), so the parser never recurses deeper than this says. Vectorised, block by block."""
    depth = deepest = 0
    in_string, backslashes = False, 0  # carried across blocks: inside a string? backslashes just before
    view = memoryview(raw)
    for start in range(0, len(raw), _CHUNK):
        codes = np.frombuffer(view[start:start + _CHUNK], dtype=np.uint8)
        pos = np.arange(len(codes))
        # The last byte at or before i that is not a backslash (-1: none in this block).
        last_plain = np.maximum.accumulate(np.where(codes != _BACKSLASH, pos, -1))
        run_before = np.empty(len(codes), dtype=np.int64)  # backslashes right before byte i
        run_before[0] = backslashes
        run_before[1:] = np.where(last_plain[:-1] >= 0, pos[:-1] - last_plain[:-1], pos[1:] + backslashes)
        quotes = (codes == _QUOTE) & (run_before % 2 == 0)  # an escaped quote ends no string
        inside = (np.cumsum(quotes) + in_string) % 2 == 1
        steps = (np.isin(codes, _OPEN) & ~inside).astype(np.int32) - (np.isin(codes, _CLOSE) & ~inside)
        levels = depth + np.cumsum(steps, dtype=np.int64)
        deepest = max(deepest, int(levels.max()))
        depth, in_string = int(levels[-1]), bool(inside[-1])
        backslashes = (backslashes + len(codes)) if last_plain[-1] < 0 else len(codes) - 1 - int(last_plain[-1])
    return deepest


def _refuse_constant(name: str) -> Any:
    def refuse(constant: str) -> Any:
        raise JsonRefused(name, f"holds {constant}, which is not JSON (numbers must be finite)")
    return refuse


def load_bounded(raw: bytes, *, name: str, max_bytes: int, max_depth: int) -> Any:
    """The parsed value of `raw`; JsonRefused naming `name` and the rule for a file larger than
    `max_bytes`, nested deeper than `max_depth`, holding NaN/Infinity, or not JSON at all."""
    if len(raw) > max_bytes:
        raise JsonRefused(name, f"is {len(raw)} bytes; this server reads at most {max_bytes} bytes of it")
    depth = nesting_depth(raw)
    if depth > max_depth:
        raise JsonRefused(name, f"nests {depth} levels deep; this server reads at most {max_depth} "
                                "(DTP_LAYOUT_JSON_MAX_DEPTH)")
    try:
        return json.loads(raw, parse_constant=_refuse_constant(name))
    except JsonRefused:
        raise
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError, JSONDecodeError, too many digits
        raise JsonRefused(name, f"is not JSON: {str(exc)[:200]}") from None


def load_object(raw: bytes, *, name: str, max_bytes: int, max_depth: int) -> dict[str, Any]:
    """`load_bounded` for a file that must hold one JSON object (a config, a safetensors header)."""
    value = load_bounded(raw, name=name, max_bytes=max_bytes, max_depth=max_depth)
    if not isinstance(value, dict):
        raise JsonRefused(name, f"is not a JSON object (it holds a {type(value).__name__})")
    return value


__all__ = ["JsonRefused", "load_bounded", "load_object", "nesting_depth"]
