"""The layouts an optimise run builds, each scored in both affinity units (§3, §5.4 and Table 3 of the paper).

    optimised           J maximised over KV groups and neurons of every layer
    with ablations (the paper's seven spread layouts, which cover the score axis):
    anti-optimised      J minimised (the negative control)
    heads-only          KV groups moved, neurons contiguous
    neurons-only        neurons moved, KV groups contiguous
    add-score           optimised on the other up-edge score (ADD for an FO run, `fo-score` for an ADD run)
    4-layers, 8-layers, 12-layers
                        only k evenly spaced layers optimised (always layer 0), the rest contiguous
    optimised-restarts-0
                        only when restarts > 0: the paper's single start from the contiguous heads, so that
                        neurons-only (whose KV groups never move, so restarts cannot change it) is compared
                        with an optimised layout found at equal restarts
    contiguous, random-<seed>   scored, not optimised

Every layout's `score` is its report in the run's score units (J, per-edge co-located fractions, bound),
plus `scores` with the same report in FO and in ADD units whichever score built it, `objective` (the score
it was optimised on, None for contiguous/random) and `restarts` (the extra optimiser starts it used).
Pure numpy (no torch): the `score` command and the API process use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from models.affinity_scores import SCORES, other_score
from models.layouts import layout as layout_mod
from models.layouts.layout import Layout, ModelShape
from models.layouts.names import RANDOM_SEED_BASE
from models.optimise import Affinity, OptimiseResult, balanced_assignment, optimise, score, upper_bound

if TYPE_CHECKING:
    from models.affinity_file import AffinityResult

LAYER_COUNTS = (4, 8, 12)  # the paper's layer-subset ablations
PAPER_RESTARTS = 0  # the paper starts the coordinate ascent once, from the contiguous KV groups
PAPER_REFERENCE = "optimised-restarts-0"


@dataclass(frozen=True)
class Variant:
    """How one optimised layout is built: optimiser options and the up-edge score it optimises."""

    name: str
    maximise: bool = True
    move_heads: bool = True
    move_neurons: bool = True
    layer_count: int | None = None  # None: every layer moves
    other_score: bool = False  # optimise on the score the run does not use
    paper_restarts: bool = False  # always restarts 0, whatever the run's restarts


def ablation_variants(score_name: str = "fo", restarts: int = 0) -> list[Variant]:
    """The seven spread layouts of Table 3 (plus the equal-restarts reference when restarts > 0)."""
    variants = [
        Variant("anti-optimised", maximise=False),
        Variant("heads-only", move_neurons=False),
        Variant("neurons-only", move_heads=False),
        Variant(f"{other_score(score_name)}-score", other_score=True),
        *(Variant(f"{k}-layers", layer_count=k) for k in LAYER_COUNTS),
    ]
    if restarts > 0:
        variants.append(Variant(PAPER_REFERENCE, paper_restarts=True))
    return variants


def ablation_names(score_name: str = "fo", restarts: int = 0) -> list[str]:
    return [v.name for v in ablation_variants(score_name, restarts)]


def evenly_spaced_layers(num_layers: int, count: int) -> list[int]:
    """`count` layers spread evenly over `num_layers` (clipped to it), always layer 0: round(j·N/k), j < k.

    Round half to even, which gives the paper's choices (Figure 9, N=28: 8 layers are 0,4,7,10,14,18,21,24).
    """
    if num_layers < 1 or count < 1:
        raise ValueError(f"need num_layers ≥ 1 and count ≥ 1, got {num_layers}, {count}")
    count = min(count, num_layers)
    return sorted({round(j * num_layers / count) for j in range(count)})


def affinity_for(result: AffinityResult, score_name: str) -> Affinity:
    return Affinity(up=result.up(score_name), down=result.down)


def restarts_used(variant: Variant, restarts: int) -> int:
    # Without moving KV groups every start is the contiguous one: restarts cannot change the result.
    return 0 if variant.paper_restarts or not variant.move_heads else restarts


def run_variant(result: AffinityResult, variant: Variant, *, devices: int, score_name: str,
                restarts: int) -> OptimiseResult:
    built_with = other_score(score_name) if variant.other_score else score_name
    affinity = affinity_for(result, built_with)
    layers = None if variant.layer_count is None else evenly_spaced_layers(result.shape.num_layers,
                                                                           variant.layer_count)
    return optimise(affinity, devices, maximise=variant.maximise, move_heads=variant.move_heads,
                    move_neurons=variant.move_neurons, layers=layers, bound=upper_bound(affinity, devices),
                    restarts=restarts_used(variant, restarts))


def score_both(result: AffinityResult, kv_group_device: Any, neuron_device: Any, devices: int) -> dict[str, dict]:
    """The layout's report in FO and in ADD units: {"fo": {...}, "add": {...}}."""
    out: dict[str, dict] = {}
    for name in SCORES:
        affinity = affinity_for(result, name)
        out[name] = score(affinity, kv_group_device, neuron_device, devices=devices,
                          bound=upper_bound(affinity, devices)).as_dict()
    return out


def scored_layout(lay: Layout, result: AffinityResult, *, score_name: str, objective: str | None,
                  restarts: int | None, layers: Sequence[int] | None = None) -> Layout:
    """`lay` with its score in the run's units, in both units, and how it was built."""
    both = score_both(result, lay.kv_group_device, lay.neuron_device, lay.devices)
    report: dict[str, Any] = {**both[score_name], "score": score_name, "objective": objective,
                              "restarts": restarts, "scores": both}
    if layers is not None:
        report["layers"] = list(layers)
    return lay.with_name(lay.name, report)


def build_layouts(result: AffinityResult, *, devices: int, delta: int, score_name: str = "fo",
                  random_layouts: int = 0, ablations: bool = False, restarts: int = 4) -> dict[str, Layout]:
    """optimised, (optionally) the ablations, contiguous and random-<seed>, each with its score."""
    shape: ModelShape = result.shape
    layout_mod.check_devices(shape, devices)
    layout_mod.check_delta(shape, delta)
    if score_name not in SCORES:
        raise ValueError(f"score must be one of {', '.join(SCORES)}, got {score_name!r}")
    variants = [Variant("optimised"), *(ablation_variants(score_name, restarts) if ablations else [])]
    layouts: dict[str, Layout] = {}
    for variant in variants:
        best = run_variant(result, variant, devices=devices, score_name=score_name, restarts=restarts)
        lay = Layout(variant.name, devices, delta, shape, best.kv_group_device, best.neuron_device)
        layers = (None if variant.layer_count is None
                  else evenly_spaced_layers(shape.num_layers, variant.layer_count))
        built_with = other_score(score_name) if variant.other_score else score_name
        layouts[variant.name] = scored_layout(lay, result, score_name=score_name, objective=built_with,
                                              restarts=restarts_used(variant, restarts), layers=layers)
    fixed = [layout_mod.contiguous(shape, devices, delta)]
    fixed += [layout_mod.random(shape, devices, delta, RANDOM_SEED_BASE + k) for k in range(random_layouts)]
    for lay in fixed:
        layouts[lay.name] = scored_layout(lay, result, score_name=score_name, objective=None, restarts=None)
    return layouts


def neuron_agreement(a: Layout, b: Layout) -> dict[str, Any]:
    """How many neurons two layouts put on the same device, under the best relabelling of the devices.

    One relabelling for the whole model (J is invariant to a global permutation of the device ids, not
    to a per-layer one, since the down edge ties layer i's neurons to layer i+1's KV groups), found as an
    exact assignment on the [L, L] table of neurons shared by device l of `a` and device m of `b`.
    Chance level is about 1/L.
    """
    if a.neuron_device.shape != b.neuron_device.shape or a.devices != b.devices:
        raise ValueError("layouts of different shapes or device counts")
    devices = a.devices
    table = np.zeros((devices, devices))
    np.add.at(table, (a.neuron_device.ravel(), b.neuron_device.ravel()), 1.0)  # [L, L]
    relabel = balanced_assignment(table)  # device l of a ↔ device relabel[l] of b
    same = relabel[a.neuron_device] == b.neuron_device  # [N, I]
    same_groups = relabel[a.kv_group_device] == b.kv_group_device  # [N, G]
    return {
        "neurons": float(same.mean()),
        "neurons_per_layer": same.mean(axis=1).tolist(),
        "kv_groups": float(same_groups.mean()),
        "relabelling": relabel.tolist(),
        "chance": 1.0 / devices,
    }
