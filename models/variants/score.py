"""Rescoring saved layouts on a saved affinity (the `dtp-layout score` command), without torch.

For each layout: J of objective (6) in the chosen up-edge units (fo or add), J over the upper bound,
the random expectation, and the co-located fraction of every up edge (layer i's KV groups → its
neurons) and down edge (layer i's neurons → layer i+1's KV groups).

With a schedule (issue 20), J_σ of that schedule's edges instead (the affinity must hold them), each edge
weighted by its first-order damage (issue 29), with every edge's fraction, mass, weight and term, the mass
the affinity's sparse neuron → neuron edges kept (`kept_mass`), and each layout's `rank` by J_σ (1: the
highest; the table lists the layouts in that order). A layout made for another schedule (its recorded
`schedule`, dtp:1 when it records none) is scored all the same — scoring the dtp:1-optimised layout at
dtp:2 is a comparison the study makes — and its row says so (`made_for`, and a warning in `warnings`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from models.affinity.file import AffinityResult
from models.base.layout_format import LayoutError
from models.layouts import layout as layout_mod
from models.optimise import score, upper_bound
from models.optimise.edges import SparseEdge, edge_name
from models.schedules.grammar import ScheduleSpec, dtp_spec, resolve_schedule
from models.variants.set import CHAIN, affinity_for

SCORES_FORMAT = "dtp-layout-scores/1"

# What docs/schedules.md measured (issue 29): no damage score tried (J_σ, the raw, joint or unabsorbed damage,
# with or without the block's first position) orders a layout made for another schedule the way it trains,
# while the trained runs' own KL at step 20 of 50 already did. The warning says so rather than let the rank
# stand for more than it is.
OTHER_SCHEDULE_CAVEAT = ("J_σ is not shown to rank a layout made for another schedule the way it trains (on "
                         "SmolLM2-135M it ranks the dtp:1 layout above contiguous under dtp:2, and that layout "
                         "trains behind it: docs/schedules.md); compare such layouts by training them with "
                         "`dtp-layout distill`")


def rescore(affinity_path: str | Path, layout_paths: Sequence[str | Path], *, score_name: str = "fo",
            schedule: ScheduleSpec | None = CHAIN) -> dict[str, Any]:
    """{format, affinity, score, schedule, tokens, layouts: [{name, path, devices, J, J_over_bound, …}], warnings}.

    schedule: score J_σ of that schedule (`CHAIN`: the paper's chain objective, J_σ of dtp:1).
    ValueError (LayoutError for a layout) naming the file when a file is unreadable or does not fit the
    affinity's model shape, or the affinity lacks the schedule's edges.
    """
    result = AffinityResult.load(affinity_path)
    affinity = affinity_for(result, score_name)
    rows = []
    warnings = []
    scored_for = str(dtp_spec(1) if schedule is CHAIN else schedule)
    for path in layout_paths:
        lay = layout_mod.load(path)
        try:
            layout_mod.check_fits(lay, result.shape)
        except LayoutError as exc:
            raise LayoutError(f"{path}: {exc} (affinity {affinity_path})") from exc
        extra: dict[str, Any] = {}
        if schedule is not CHAIN:
            resolved = resolve_schedule(schedule, result.shape.num_layers, lay.devices)
            scored_for = str(resolved)
            sigma = result.schedule_affinity(score_name, resolved)
            srep = score(sigma, lay.kv_group_device, lay.neuron_device, devices=lay.devices,
                         bound=upper_bound(sigma, lay.devices))
            J, bound_value, exact, up, down = (srep.J, srep.upper_bound, srep.upper_bound_exact, srep.up_fraction,
                                               srep.down_fraction)
            random_expectation = srep.random_expectation
            extra = {"edges": srep.edges, "layout_independent": srep.layout_independent,
                     "weighting": srep.weighting, "kept_mass": srep.kept_mass}
        else:
            rep = score(affinity, lay.kv_group_device, lay.neuron_device, devices=lay.devices,
                        bound=upper_bound(affinity, lay.devices))
            J, bound_value, exact = rep.J, rep.upper_bound, rep.upper_bound_exact
            up, down = list(rep.up_fraction), list(rep.down_fraction)
            random_expectation = rep.random_expectation
        if lay.made_for != scored_for:
            warnings.append(f"{path}: layout {lay.name!r} was made for schedule {lay.made_for}, scored here "
                            f"for {scored_for}; {OTHER_SCHEDULE_CAVEAT}")
        rows.append({"name": lay.name, "path": str(path), "devices": lay.devices, "made_for": lay.made_for,
                     "J": J, "J_over_bound": J / bound_value if bound_value else None,
                     "random_expectation": random_expectation, "upper_bound": bound_value,
                     "upper_bound_exact": exact, "up_fraction": up, "down_fraction": down, **extra})
    order = sorted(range(len(rows)), key=lambda k: -rows[k]["J"])
    for rank, k in enumerate(order, start=1):
        rows[k]["rank"] = rank
    return {"format": SCORES_FORMAT, "affinity": str(affinity_path), "score": score_name, "schedule": scored_for,
            "tokens": result.tokens, "num_layers": result.shape.num_layers, "layouts": rows, "warnings": warnings,
            "kept_mass": edge_kept_mass(result, score_name) if schedule is not CHAIN else None}


def edge_kept_mass(result: AffinityResult, score_name: str) -> dict[str, Any] | None:
    """{min, median, max, edges: {name: kept}} of the affinity's sparse edges in `score_name` units; None
    when every edge is dense (torch-free twin of `models.run.pipeline.edge_kept_mass`'s use)."""
    kept = {edge_name(p): m.kept_mass for p, scores in sorted(result.edges.items())
            for name, m in scores.items() if name == score_name and isinstance(m, SparseEdge)}
    if not kept:
        return None
    values = sorted(kept.values())
    return {"min": values[0], "median": float(np.median(values)), "max": values[-1], "edges": kept}


def score_table(doc: dict[str, Any]) -> str:
    """The summary (one row per layout, by rank) and the per-layer up/down co-located fractions."""
    rows = sorted(doc["layouts"], key=lambda r: r.get("rank", 0))
    width = max(12, *(len(r["name"]) + 2 for r in rows))
    lines = [f"J in {doc['score'].upper()} units for schedule {doc.get('schedule', 'dtp:1')}, {doc['tokens']} "
             f"calibration tokens ({doc['affinity']})",
             f"{'layout':<{width}}{'L':>4}{'J':>10}{'J/bound':>9}{'random':>9}{'bound':>9}"]
    for r in rows:
        ratio = f"{r['J_over_bound']:.3f}" if r["J_over_bound"] is not None else "–"
        bound = f"{r['upper_bound']:.3f}" + ("" if r["upper_bound_exact"] else "*")
        lines.append(f"{r['name']:<{width}}{r['devices']:>4}{r['J']:>10.3f}{ratio:>9}"
                     f"{r['random_expectation']:>9.3f}{bound:>9}")
    if any(not r["upper_bound_exact"] for r in rows):
        lines.append("* relaxed bound (too many KV-group partitions to enumerate, or a sparse edge)")
    if doc.get("schedule", "dtp:1") != "dtp:1" and rows and rows[0].get("weighting") == "damage":
        lines.append("J_σ weighs each edge by its first-order damage over the paper's edge into the same module")
    if doc.get("kept_mass"):
        kept = doc["kept_mass"]
        lines.append(f"sparse neuron→neuron edges kept {kept['min']:.3f}..{kept['max']:.3f} of their mass "
                     f"(median {kept['median']:.3f}): the rest is not scored")
    col = max(11, *(len(r["name"]) + 1 for r in rows))
    lines += ["", "co-located fraction per layer, up / down edge (– : not an edge of the schedule)",
              "layer" + "".join(f"{r['name']:>{col}}" for r in rows)]
    for i in range(doc["num_layers"]):
        cells = []
        for r in rows:
            down = r["down_fraction"][i] if i < len(r["down_fraction"]) else None
            up = r["up_fraction"][i]
            cells.append(f"{_fraction(up)} / {_fraction(down)}".rjust(col))
        lines.append(f"{i:<5}" + "".join(cells))
    return "\n".join(lines)


def _fraction(value: float | None) -> str:
    return "  – " if value is None else f"{value:.2f}"
