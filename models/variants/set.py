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
With a schedule (issue 20) every layout is optimised and scored on J_σ, the objective of that schedule's
edges (`models.optimise.objective`), and records the schedule; dtp:0 and dtp:1 optimise the paper's chain
objective (`CHAIN`: J_σ of dtp:1, which the chain's affinity pass computes exactly as before issue 20), and
their layouts record no schedule.
Pure numpy (no torch): the `score` command and the API process use it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from models.affinity.names import SCORES, other_score
from models.base.layout_format import LayoutError
from models.base.shapes import ModelShape
from models.layouts import layout as layout_mod
from models.layouts.layout import Layout
from models.layouts.names import RANDOM_SEED_BASE
from models.optimise import Affinity, OptimiseResult, Problem, balanced_assignment, optimise, score, upper_bound
from models.schedules.grammar import (
    Schedule,
    ScheduleError,
    ScheduleSpec,
    parse_schedule,
    resolve_schedule,
)

if TYPE_CHECKING:
    from models.affinity.file import AffinityResult

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
    return Affinity(up=result.up(score_name), down=result.down, experts=result.shape.num_experts)


# The paper's chain objective, as an objective table: no table, the affinity pass's chain edges alone. dtp:0 and
# dtp:1 optimise it (`optimises_chain`); every function below taking `schedule: Schedule | None` reads None so.
CHAIN: None = None


def optimises_chain(schedule: ScheduleSpec) -> bool:
    """Whether `schedule`'s layouts optimise the paper's chain objective (`CHAIN`): dtp:1, whose J_σ the chain
    is, and dtp:0, where every module is exchanged before the next reads it (no layout is better than another:
    the chain objective is kept, as it always was)."""
    return schedule.kind == "dtp" and schedule.upper is None and schedule.delta <= 1


def objective_affinity(result: AffinityResult, score_name: str, schedule: Schedule | None) -> Problem:
    """What a layout is optimised and scored on: `schedule`'s edges, or the paper's chain (`CHAIN`)."""
    return affinity_for(result, score_name) if schedule is None else result.schedule_affinity(score_name, schedule)


def restarts_used(variant: Variant, restarts: int) -> int:
    # Without moving KV groups every start is the contiguous one: restarts cannot change the result.
    return 0 if variant.paper_restarts or not variant.move_heads else restarts


def objective_schedule(schedule: ScheduleSpec, *, num_layers: int, devices: int,
                       resolved: str | None = None) -> Schedule | None:
    """The schedule a layout is optimised for, resolved for the model; `CHAIN` (None): the paper's chain
    objective, for dtp:0 and dtp:1 (`optimises_chain`).

    spd:auto:K needs `resolved`, the spd:B its calibration sensitivities chose (`models.evaluation.spd_auto`; an
    affinity file records it as its schedule). ScheduleError when it does not fit the model or is
    spd:auto:K without `resolved`; LayoutError when it leaves nothing to optimise (tp, ladder).
    """
    if optimises_chain(schedule):
        return CHAIN
    spec = schedule
    if spec.kind == "spd-auto":
        if resolved is None:
            raise ScheduleError(f"schedule {spec}: its layers are chosen by their sensitivity on the calibration "
                                f"blocks (the affinity stage does it); give the layers as spd:B here")
        chosen = parse_schedule(resolved)
        if chosen.kind != "spd" or len(chosen.layers) != spec.count:
            raise ScheduleError(f"schedule {spec}: the affinity was computed for schedule {resolved}, not for "
                                f"{spec.count} layers chosen by sensitivity")
        spec = chosen
    resolved_schedule = resolve_schedule(spec, num_layers, devices)
    refuse_layout_independent(resolved_schedule)
    return resolved_schedule


def refuse_layout_independent(schedule: Schedule | None) -> None:
    """LayoutError when `schedule` leaves nothing to optimise (a_n = b_n for every module: tp, ladder)."""
    if schedule is not None and schedule.layout_independent:
        raise LayoutError(f"schedule {schedule}: every module's partial reaches every device when the device's "
                          f"own does (a_n = b_n for all n), so the model computes the same function under every "
                          f"layout and J_σ is 0 for all of them: there is no layout to optimise (evaluate or run "
                          f"it with any layout, e.g. contiguous)")


def run_variant(result: AffinityResult, variant: Variant, *, devices: int, score_name: str,
                restarts: int, schedule: Schedule | None = None,
                done: Callable[[float], None] | None = None) -> OptimiseResult:
    """The variant's optimised layout: on J_σ of `schedule`, or on the chain objective (None); done(fraction)
    as the optimiser's ascents go (`models.optimise.ascent.optimise`)."""
    built_with = other_score(score_name) if variant.other_score else score_name
    layers = None if variant.layer_count is None else evenly_spaced_layers(result.shape.num_layers,
                                                                           variant.layer_count)
    options: dict[str, Any] = dict(maximise=variant.maximise, move_heads=variant.move_heads,
                                   move_neurons=variant.move_neurons, layers=layers,
                                   restarts=restarts_used(variant, restarts))
    refuse_layout_independent(schedule)
    affinity = objective_affinity(result, built_with, schedule)
    return optimise(affinity, devices, bound=upper_bound(affinity, devices), done=done, **options)


def score_both(result: AffinityResult, kv_group_device: Any, neuron_device: Any, devices: int,
               schedule: Schedule | None = None) -> dict[str, dict]:
    """The layout's report in FO and in ADD units: {"fo": {...}, "add": {...}} (J_σ with a schedule)."""
    out: dict[str, dict] = {}
    for name in SCORES:
        affinity = objective_affinity(result, name, schedule)
        out[name] = score(affinity, kv_group_device, neuron_device, devices=devices,
                          bound=upper_bound(affinity, devices)).as_dict()
    return out


def scored_layout(lay: Layout, result: AffinityResult, *, score_name: str, objective: str | None,
                  restarts: int | None, layers: Sequence[int] | None = None,
                  schedule: Schedule | None = None) -> Layout:
    """`lay` with its score in the run's units, in both units, and how it was built."""
    both = score_both(result, lay.kv_group_device, lay.neuron_device, lay.devices, schedule)
    report: dict[str, Any] = {**both[score_name], "score": score_name, "objective": objective,
                              "restarts": restarts, "scores": both}
    if layers is not None:
        report["layers"] = list(layers)
    return lay.with_name(lay.name, report)


# The optimising stage's progress in units of work: one per coordinate ascent of a variant (1 + its
# restarts) and one per layout scored (both units, each with its bound). At SmolLM2-135M's shape on the chain
# objective (bench/optimiser.py's synthetic affinity, L=3, 2 cores) one ascent took 0.15 s and one layout's
# scoring 0.27 s: the same order, so they count alike; a pt:2 job spent 80 s here with its bar at 0 %.
def _work_units(variants: Sequence[Variant], restarts: int, fixed_layouts: int) -> tuple[list[int], int]:
    """The units of each variant's optimisation, and of all the layouts' scoring."""
    return [1 + restarts_used(v, restarts) for v in variants], len(variants) + fixed_layouts


def build_layouts(result: AffinityResult, *, devices: int, delta: int, score_name: str = "fo",
                  random_layouts: int = 0, ablations: bool = False, restarts: int = 4,
                  schedule: Schedule | None = None, progress: Callable[[float], None] | None = None
                  ) -> dict[str, Layout]:
    """optimised, (optionally) the ablations, contiguous and random-<seed>, each with its score.

    schedule: optimise and score on J_σ of that schedule, and record it in every layout (LayoutError for a
    layout-independent one; ValueError when the affinity lacks its edges); None: the chain objective.
    progress(fraction) after every optimiser sweep and every layout scored (`_work_units`).
    """
    refuse_layout_independent(schedule)
    recorded = None if schedule is None else str(schedule)
    shape: ModelShape = result.shape
    layout_mod.check_devices(shape, devices)
    layout_mod.check_delta(shape, delta)
    if score_name not in SCORES:
        raise ValueError(f"score must be one of {', '.join(SCORES)}, got {score_name!r}")
    variants = [Variant("optimised"), *(ablation_variants(score_name, restarts) if ablations else [])]
    ascents, scorings = _work_units(variants, restarts, 1 + random_layouts)
    total, before = float(sum(ascents) + scorings), 0.0

    def tell(units_done: float) -> None:
        if progress is not None:
            progress(min(1.0, (before + units_done) / total))

    layouts: dict[str, Layout] = {}
    for variant, share in zip(variants, ascents, strict=True):
        def optimised(fraction: float, share: int = share) -> None:
            tell(fraction * share)

        best = run_variant(result, variant, devices=devices, score_name=score_name, restarts=restarts,
                           schedule=schedule, done=optimised)
        before += share
        lay = Layout(variant.name, devices, delta, shape, best.kv_group_device, best.neuron_device,
                     schedule=recorded)
        layers = (None if variant.layer_count is None
                  else evenly_spaced_layers(shape.num_layers, variant.layer_count))
        built_with = other_score(score_name) if variant.other_score else score_name
        layouts[variant.name] = scored_layout(lay, result, score_name=score_name, objective=built_with,
                                              restarts=restarts_used(variant, restarts), layers=layers,
                                              schedule=schedule)
        before += 1
        tell(0.0)
    fixed = [layout_mod.contiguous(shape, devices, delta)]
    fixed += [layout_mod.random(shape, devices, delta, RANDOM_SEED_BASE + k) for k in range(random_layouts)]
    for lay in fixed:
        lay = Layout(lay.name, devices, delta, shape, lay.kv_group_device, lay.neuron_device, schedule=recorded)
        layouts[lay.name] = scored_layout(lay, result, score_name=score_name, objective=None, restarts=None,
                                          schedule=schedule)
        before += 1
        tell(0.0)
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
