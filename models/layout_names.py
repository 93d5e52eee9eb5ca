"""Layout names: the one grammar by which export, eval, distill and the service name a layout.

    contiguous                 the storage-order (standard tensor-parallel) layout
    random:SEED | random-SEED  the seeded uniform balanced layout; one layout, named random-SEED
    NAME                       NAME.json of an optimise output's layouts/ directory: optimised, the
                               ablations, and the contiguous and random-SEED layouts it scored
    PATH                       an existing dtp-layout/1 JSON file

A name stored in the layouts directory wins over building it (it is the same layout, with its
score). `parse_layout_name` is the syntax alone (no files, usable where requests are validated);
`resolve_layout` turns a name into a `Layout` fitted to the model, devices and δ of the run.
Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from models import layout as layout_mod
from models.layout import Layout, LayoutError, ModelShape

CONTIGUOUS = "contiguous"
_RANDOM = re.compile(r"^random[:-](.*)$")
_SEED = re.compile(r"^[0-9]{1,19}$")
# What an optimise output names its layouts (and so what can be looked up in its layouts/ directory).
_STORED = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
GRAMMAR = "'contiguous', 'random:SEED' (or 'random-SEED'), an existing dtp-layout/1 JSON file"

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


def resolve_layout(text: str, *, shape: ModelShape, devices: int, delta: int,
                   layouts_dir: str | Path | None = None) -> Layout:
    """The layout named `text` for a model of `shape` on `devices` devices at delay `delta`.

    A layout read from a file keeps its assignment (and score) and takes the run's δ; one stored
    under `layouts_dir` takes the requested name, one from a JSON path keeps the name it has.
    """
    layout_mod.check_devices(shape, devices)
    layout_mod.check_delta(shape, delta)
    parsed = parse_layout_name(text)
    if parsed.kind != "path" and layouts_dir is not None:
        stored = Path(layouts_dir) / f"{parsed.name}.json"
        if stored.is_file():  # an optimise output: the same layout, with its score
            return _fit(layout_mod.load(stored), parsed.name, shape, devices, delta)
    if parsed.kind == "contiguous":
        return layout_mod.contiguous(shape, devices, delta)
    if parsed.kind == "random":
        assert parsed.seed is not None
        return layout_mod.random(shape, devices, delta, parsed.seed)
    path = Path(text)
    if path.is_file():
        lay = layout_mod.load(path)
        return _fit(lay, lay.name, shape, devices, delta)
    raise LayoutError(_unknown(text, parsed, layouts_dir))


def _unknown(text: str, parsed: LayoutName, layouts_dir: str | Path | None) -> str:
    if parsed.kind == "path":
        return f"layout {text!r}: no such file; expected {GRAMMAR}, or a layout name of an optimise output"
    if layouts_dir is None:
        return (f"layout {text!r}: expected {GRAMMAR}, or a layout name of an optimise output "
                "(no layouts directory given: --from DIR)")
    known = sorted(p.stem for p in Path(layouts_dir).glob("*.json"))
    return (f"layout {text!r}: expected {GRAMMAR}, or a layout of {layouts_dir}"
            + (f" (it has: {', '.join(known)})" if known else " (it has none)"))


def _fit(lay: Layout, name: str, shape: ModelShape, devices: int, delta: int) -> Layout:
    layout_mod.check_fits(lay, shape)
    if lay.devices != devices:
        raise LayoutError(f"layout {name!r} has devices={lay.devices}, but the run asks for devices={devices}")
    return Layout(name, devices, delta, lay.shape, lay.kv_group_device, lay.neuron_device, lay.score)
