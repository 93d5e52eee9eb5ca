"""Layouts: which device holds each KV group and each FFN neuron, per layer; how they are named, built
and scored. One module per concept, each importing only those above it in this list:

    format.py     the file format's name (`dtp-layout/1`) and `LayoutError` (dependency-free)
    names.py      the grammar of layout names and the seeds of random layouts (dependency-free)
    layout.py     `ModelShape` and `Layout`: balance, checks, contiguous and random layouts, JSON
    resolve.py    a layout name turned into a `Layout` for one run (files of an optimise output)
    set.py        the layouts an optimise run builds: optimised, the paper's ablations, baselines
    score.py      saved layouts rescored on a saved affinity (`dtp-layout score`)
    stability.py  calibration stability: each half's layout scored on the other half

Torch-free. Every public name is importable from `models.layouts`; the submodules load on first use,
so importing one of them (say `models.layouts.names`, for the CLI's help) loads nothing else. Eager
imports here would close a circle: `models.affinity.file` needs `ModelShape` (so runs this package
first), and `score.py` reads affinity files.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> submodule that defines it
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("LAYOUT_FORMAT", "LayoutError"), "format"),
    **dict.fromkeys(("CONTIGUOUS", "GRAMMAR", "RANDOM_SEED_BASE", "LayoutName", "canonical_layout_name",
                     "parse_layout_name", "random_name"), "names"),
    **dict.fromkeys(("Layout", "ModelShape", "check_delta", "check_devices", "check_fits", "contiguous",
                     "from_json_dict", "load", "random", "valid_device_counts", "validate"), "layout"),
    "resolve_layout": "resolve",
    **dict.fromkeys(("LAYER_COUNTS", "PAPER_REFERENCE", "PAPER_RESTARTS", "Variant", "ablation_names",
                     "ablation_variants", "affinity_for", "build_layouts", "evenly_spaced_layers",
                     "neuron_agreement", "restarts_used", "run_variant", "score_both", "scored_layout"), "set"),
    **dict.fromkeys(("SCORES_FORMAT", "rescore", "score_table"), "score"),
    **dict.fromkeys(("HALVES", "half_layouts", "stability_report"), "stability"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:  # what __getattr__ resolves, for type checkers
    from models.layouts.format import LAYOUT_FORMAT as LAYOUT_FORMAT
    from models.layouts.format import LayoutError as LayoutError
    from models.layouts.layout import Layout as Layout
    from models.layouts.layout import ModelShape as ModelShape
    from models.layouts.layout import check_delta as check_delta
    from models.layouts.layout import check_devices as check_devices
    from models.layouts.layout import check_fits as check_fits
    from models.layouts.layout import contiguous as contiguous
    from models.layouts.layout import from_json_dict as from_json_dict
    from models.layouts.layout import load as load
    from models.layouts.layout import random as random
    from models.layouts.layout import valid_device_counts as valid_device_counts
    from models.layouts.layout import validate as validate
    from models.layouts.names import CONTIGUOUS as CONTIGUOUS
    from models.layouts.names import GRAMMAR as GRAMMAR
    from models.layouts.names import RANDOM_SEED_BASE as RANDOM_SEED_BASE
    from models.layouts.names import LayoutName as LayoutName
    from models.layouts.names import canonical_layout_name as canonical_layout_name
    from models.layouts.names import parse_layout_name as parse_layout_name
    from models.layouts.names import random_name as random_name
    from models.layouts.resolve import resolve_layout as resolve_layout
    from models.layouts.score import SCORES_FORMAT as SCORES_FORMAT
    from models.layouts.score import rescore as rescore
    from models.layouts.score import score_table as score_table
    from models.layouts.set import LAYER_COUNTS as LAYER_COUNTS
    from models.layouts.set import PAPER_REFERENCE as PAPER_REFERENCE
    from models.layouts.set import PAPER_RESTARTS as PAPER_RESTARTS
    from models.layouts.set import Variant as Variant
    from models.layouts.set import ablation_names as ablation_names
    from models.layouts.set import ablation_variants as ablation_variants
    from models.layouts.set import affinity_for as affinity_for
    from models.layouts.set import build_layouts as build_layouts
    from models.layouts.set import evenly_spaced_layers as evenly_spaced_layers
    from models.layouts.set import neuron_agreement as neuron_agreement
    from models.layouts.set import restarts_used as restarts_used
    from models.layouts.set import run_variant as run_variant
    from models.layouts.set import score_both as score_both
    from models.layouts.set import scored_layout as scored_layout
    from models.layouts.stability import HALVES as HALVES
    from models.layouts.stability import half_layouts as half_layouts
    from models.layouts.stability import stability_report as stability_report
