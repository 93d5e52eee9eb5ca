"""Layout names: the one grammar by which export, eval, distill and the service name a layout.

    contiguous                 the storage-order (standard tensor-parallel) layout
    random:SEED | random-SEED  the seeded uniform balanced layout; one layout, named random-SEED
    NAME                       NAME.json of an optimise output's layouts/ directory: optimised, the
                               ablations, and the contiguous and random-SEED layouts it scored
    PATH                       an existing dtp-layout/1 JSON file

The syntax alone: no files and no numpy, usable where requests are validated and in the CLI's help.
`models.layouts.resolve` turns a name into a `Layout` fitted to the model, devices and δ of the run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from models.base.layout_format import LAYOUT_FORMAT, LayoutError

CONTIGUOUS = "contiguous"
RANDOM_SEED_BASE = 1000  # an optimise run's K random layouts use seeds 1000 … 1000+K-1, as in the paper
_RANDOM = re.compile(r"^random[:-](.*)$")
_SEED = re.compile(r"^[0-9]{1,19}$")
# What an optimise output names its layouts (and so what can be looked up in its layouts/ directory).
_STORED = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
GRAMMAR = f"'{CONTIGUOUS}', 'random:SEED' (or 'random-SEED'), an existing {LAYOUT_FORMAT} JSON file"

NameKind = Literal["contiguous", "random", "stored", "path"]


@dataclass(frozen=True)
class LayoutName:
    """A parsed layout name: `name` is canonical (random:SEED becomes random-SEED)."""

    kind: NameKind
    name: str
    seed: int | None = None


def random_name(seed: int) -> str:
    """The canonical name of the seeded random layout, as `optimise` writes it."""
    return f"random-{seed}"


def parse_layout_name(text: str) -> LayoutName:
    """The syntax of a layout name; raises LayoutError for a malformed random seed or an empty name.

    kind is `stored` for a bare name (looked up in a layouts directory) and `path` for anything that
    can only be a file (it ends in .json or contains a path separator).
    """
    if not isinstance(text, str) or not text:
        raise LayoutError(f"layout name must be a non-empty string, got {text!r}")
    if text == CONTIGUOUS:
        return LayoutName("contiguous", CONTIGUOUS)
    random = _RANDOM.match(text)
    if random:
        if not _SEED.match(random.group(1)):
            raise LayoutError(f"layout {text!r}: expected random:SEED or random-SEED with a non-negative "
                              "integer seed")
        seed = int(random.group(1))
        return LayoutName("random", random_name(seed), seed)
    if _STORED.match(text) and not text.endswith(".json"):
        return LayoutName("stored", text)
    return LayoutName("path", text)


def canonical_layout_name(text: str) -> str:
    """`random:7` → `random-7`; every other valid name unchanged."""
    return parse_layout_name(text).name
