"""A layout name (the grammar of `models.layouts.names`) turned into a `Layout` for one run.

A name stored in the layouts directory wins over building it (it is the same layout, with its score).
Torch-free.
"""

from __future__ import annotations

from pathlib import Path

from models.base.layout_format import LayoutError
from models.base.shapes import ModelShape
from models.layouts import layout as layout_mod
from models.layouts.layout import Layout
from models.layouts.names import GRAMMAR, LayoutName, parse_layout_name


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


def check_layout_name(text: str, *, layouts_dir: str | Path | None = None) -> None:
    """What `resolve_layout` refuses without the model's shape: a malformed name (random:abc), a layout file
    that does not exist, a name that no layouts directory holds. Raises LayoutError, naming what is accepted."""
    parsed = parse_layout_name(text)
    if parsed.kind in ("contiguous", "random"):
        return
    if parsed.kind != "path" and layouts_dir is not None and (Path(layouts_dir) / f"{parsed.name}.json").is_file():
        return
    if Path(text).is_file():
        return
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
    # the schedule it was optimised for stays recorded whatever δ the run gives it
    return Layout(name, devices, delta, lay.shape, lay.kv_group_device, lay.neuron_device, lay.score, lay.schedule)
