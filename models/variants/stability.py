"""Calibration stability: does the layout depend on the calibration text?

Split the calibration blocks in two halves, run the affinity pass and the optimiser on each, then score
each half's optimised layout on the other half's affinity. If the layout captured structure of the model
rather than of the text, a layout scores on the other half nearly what that half's own layout scores
(`transfer` close to 1), and the two neuron assignments agree beyond chance under the best relabelling
of the devices. Pure numpy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from models.layouts.layout import Layout
from models.optimise import score, upper_bound
from models.schedules.grammar import Schedule
from models.variants.set import Variant, affinity_for, neuron_agreement, run_variant

if TYPE_CHECKING:
    from models.affinity.file import AffinityResult

HALVES = ("first", "second")


def half_layouts(halves: dict[str, AffinityResult], *, devices: int, delta: int, score_name: str,
                 restarts: int, schedule: Schedule | None = None) -> dict[str, Layout]:
    """The optimised layout of each half, named `stability-<half>` (on J_σ of `schedule` when given)."""
    out = {}
    for half, result in halves.items():
        best = run_variant(result, Variant("optimised"), devices=devices, score_name=score_name, restarts=restarts,
                           schedule=schedule)
        out[half] = Layout(f"stability-{half}", devices, delta, result.shape, best.kv_group_device,
                           best.neuron_device, score=best.report.as_dict(),
                           schedule=None if schedule is None else str(schedule))
    return out


def stability_report(halves: dict[str, AffinityResult], layouts: dict[str, Layout], *, score_name: str,
                     restarts: int, blocks: dict[str, int], schedule: Schedule | None = None) -> dict[str, Any]:
    """J (J_σ with a schedule) of every half's layout on every half, the transfer ratios and the neuron
    agreement."""
    scores: dict[str, dict[str, float]] = {}  # layout half -> scored on half -> J
    per_half: dict[str, dict[str, Any]] = {}
    for on, result in halves.items():
        devices = layouts[on].devices
        if schedule is not None:
            sigma = result.schedule_affinity(score_name, schedule)
            sbound = upper_bound(sigma, devices)
            for built, lay in layouts.items():
                srep = score(sigma, lay.kv_group_device, lay.neuron_device, devices=devices, bound=sbound)
                scores.setdefault(built, {})[on] = srep.J
            per_half[on] = {"blocks": blocks[on], "tokens": result.tokens,
                            "random_expectation": srep.random_expectation, "upper_bound": sbound.value,
                            "upper_bound_exact": sbound.exact}
            continue
        affinity = affinity_for(result, score_name)
        bound = upper_bound(affinity, devices)
        for built, lay in layouts.items():
            rep = score(affinity, lay.kv_group_device, lay.neuron_device, devices=lay.devices, bound=bound)
            scores.setdefault(built, {})[on] = rep.J
        per_half[on] = {"blocks": blocks[on], "tokens": result.tokens, "random_expectation": rep.random_expectation,
                        "upper_bound": bound.value, "upper_bound_exact": bound.exact}
    first, second = HALVES
    cross = {
        f"{built}_on_{on}": scores[built][on] for built in HALVES for on in HALVES
    }
    # How much of a half's own optimum the other half's layout keeps, on that half's affinity.
    transfer = {on: scores[other][on] / scores[on][on] if scores[on][on] else None
                for on, other in ((first, second), (second, first))}
    return {
        "score": score_name,
        "restarts": restarts,
        "halves": per_half,
        "J": cross,
        "transfer": transfer,
        "agreement": neuron_agreement(layouts[first], layouts[second]),
    }
