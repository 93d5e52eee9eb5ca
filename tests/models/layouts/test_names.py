"""The layout-name grammar of models.layouts.names: the syntax alone, no files."""

from __future__ import annotations

import pytest

from models.base.layout_format import LayoutError
from models.layouts.names import canonical_layout_name, parse_layout_name


@pytest.mark.parametrize(("text", "kind", "name", "seed"), [
    ("contiguous", "contiguous", "contiguous", None),
    ("random:7", "random", "random-7", 7),
    ("random-7", "random", "random-7", 7),
    ("random:0042", "random", "random-42", 42),
    ("optimised", "stored", "optimised", None),
    ("heads-only", "stored", "heads-only", None),
    ("mine.json", "path", "mine.json", None),
    ("runs/opt/layouts/optimised.json", "path", "runs/opt/layouts/optimised.json", None),
    ("../optimised", "path", "../optimised", None),
])
def test_parse_layout_name(text: str, kind: str, name: str, seed: int | None) -> None:
    parsed = parse_layout_name(text)
    assert (parsed.kind, parsed.name, parsed.seed) == (kind, name, seed)
    assert canonical_layout_name(text) == name


@pytest.mark.parametrize("text", ["random:abc", "random-", "random:-3", "random:1.5", "random: 4", ""])
def test_parse_layout_name_refuses_malformed_names(text: str) -> None:
    with pytest.raises(LayoutError, match=r"random:SEED|non-empty"):
        parse_layout_name(text)
