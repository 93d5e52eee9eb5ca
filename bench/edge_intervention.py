"""One edge changed, nothing else: does a single heavy late edge decide how a layout trains under δ ≥ 2?

docs/schedules.md diagnoses J_σ(dtp:2)'s misranking of the dtp:1-optimised layout as one late
neuron → neuron edge (ffn28 → ffn29 on SmolLM2-135M) that the dtp:1 layout splits across devices. This
script makes the intervention that tests it. Relabelling the devices of one layer's FFN neurons (a
permutation of the device ids, applied to that layer's FFN only) leaves every co-located fraction
unchanged except those of the edges into and out of that FFN; for the last layer's FFN that is the
neuron → neuron edge from the FFN below and the up edge from its own attention. Of the D! relabellings:

- `optimised-broken`: the σ-optimised layout with the one that co-locates least of the neuron → neuron edge;
- `optimised-other-repaired`: the other-schedule layout with the one that co-locates most of it.

It writes both, with their two parents, into `WORK/layouts/<σ>/` and links the source's affinity, so that
`bench/schedule_experiment.py --work WORK --other ""` trains the four arms with its recipe and seeds:

    .venv/bin/python bench/edge_intervention.py --source var/sx-long --work var/sx-edge
    .venv/bin/python bench/schedule_experiment.py --schedules dtp:2 --other "" --work var/sx-edge --seeds 0,1,2

The rule (fixed before the runs, printed): "the late edge decides" only if every broken seed ends above
every σ-optimised seed and every repaired seed ends below every other-schedule seed; otherwise "not shown".
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from bench.schedule_experiment import OPTIMISED, OTHER, missing_ffn_damage
from bench.schedule_experiment_runs import slug
from models.affinity.file import AffinityResult
from models.layouts import layout as layout_mod
from models.layouts.layout import Layout
from models.optimise import score
from models.run.files import AFFINITY_FILE
from models.schedules.grammar import resolve_schedule
from models.variants.set import scored_layout

BROKEN, REPAIRED = "optimised-broken", "optimised-other-repaired"
EDGE_RULE = ('"the late edge decides" only if every seed of optimised-broken ends above every seed of optimised '
             'and every seed of optimised-other-repaired ends below every seed of optimised-other (final KL, '
             'primary set); otherwise "not shown"')


def relabel_ffn(lay: Layout, layer: int, perm: tuple[int, ...], name: str) -> Layout:
    """`lay` with layer `layer`'s FFN neurons moved from device d to perm[d]; all else as it is."""
    neuron_device = lay.neuron_device.copy()  # [N, I]
    neuron_device[layer] = np.asarray(perm)[neuron_device[layer]]
    return Layout(name, lay.devices, lay.delta, lay.shape, lay.kv_group_device, neuron_device, None, lay.schedule)


def fractions(sigma: Any, lay: Layout) -> dict[tuple[int, int], float]:
    """{(sender module, receiver module): co-located fraction} of every edge of J_σ (module 2l attention,
    2l + 1 the FFN of layer l)."""
    return edge_fractions(score(sigma, lay.kv_group_device, lay.neuron_device, devices=lay.devices).edges)


def edge_fractions(edges: list[dict[str, Any]]) -> dict[tuple[int, int], float]:
    return {(int(e["from"]), int(e["to"])): float(e["fraction"]) for e in edges}


def intervene(result: AffinityResult, optimised: Layout, other: Layout, schedule: str,
              layer: int | None = None) -> tuple[dict[str, Layout], dict[str, Any]]:
    """The two intervention layouts (scored in J_σ) and a report: each arm's objectives, the fractions of
    the edges into the FFN, the relabelling chosen and the edges whose fraction moved (only those into or
    out of the FFN may)."""
    shape = result.shape
    layer = shape.num_layers - 1 if layer is None else layer
    sched = resolve_schedule(schedule, shape.num_layers, optimised.devices)
    sigma = result.schedule_affinity("fo", sched)
    ffn, below = 2 * layer + 1, 2 * layer - 1  # the FFN's module and the FFN below it
    if (below, ffn) not in fractions(sigma, optimised):
        raise ValueError(f"{schedule} has no neuron → neuron edge ffn{layer - 1} → ffn{layer} (δ ≥ 2 needed)")
    perms = list(itertools.permutations(range(optimised.devices)))
    made: dict[str, Layout] = {}
    chosen: dict[str, tuple[int, ...]] = {}
    for base, name, pick in ((optimised, BROKEN, min), (other, REPAIRED, max)):
        perm = pick(perms, key=lambda p: fractions(sigma, relabel_ffn(base, layer, p, name))[(below, ffn)])
        chosen[name] = perm
        made[name] = scored_layout(relabel_ffn(base, layer, perm, name), result, score_name="fo", objective="fo",
                                   restarts=None, schedule=sched)
    report: dict[str, Any] = {"schedule": schedule, "layer": layer, "edge": [below, ffn], "rule": EDGE_RULE,
                              "arms": {}}
    for name, lay in ((OPTIMISED, optimised), (BROKEN, made[BROKEN]), (OTHER, other), (REPAIRED, made[REPAIRED])):
        got = score(sigma, lay.kv_group_device, lay.neuron_device, devices=lay.devices)
        unit = score(sigma.with_weighting("unit"), lay.kv_group_device, lay.neuron_device, devices=lay.devices)
        frac = edge_fractions(got.edges)
        report["arms"][name] = {"J_damage": got.J, "J_unit": unit.J,
                                "neg_missing_ffn_damage": -missing_ffn_damage(got.edges),
                                "into_ffn": {f"{a}->{b}": frac[(a, b)] for a, b in frac if b == ffn}}
    for name, parent in ((BROKEN, optimised), (REPAIRED, other)):
        before, after = fractions(sigma, parent), fractions(sigma, made[name])
        report["arms"][name]["relabelling"] = list(chosen[name])
        report["arms"][name]["edges_changed"] = sorted([a, b] for (a, b), f in after.items()
                                                       if abs(f - before[(a, b)]) > 1e-12)
    return made, report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, required=True,
                    help="a schedule_experiment work directory with σ's affinity and optimised layout")
    ap.add_argument("--work", type=Path, required=True, help="where the four arms go (a new work directory)")
    ap.add_argument("--schedule", default="dtp:2")
    ap.add_argument("--layer", type=int, default=None, help="the FFN to relabel (default: the last layer's)")
    ap.add_argument("--restarts", type=int, default=2, help="the dtp:1 layout's optimiser restarts when it is built")
    args = ap.parse_args(argv)
    from models.variants.set import build_layouts

    name = slug(args.schedule)
    result = AffinityResult.load(args.source / "affinity" / name / AFFINITY_FILE)
    src = args.source / "layouts" / name
    optimised = layout_mod.load(src / f"{OPTIMISED}.json")
    sched = resolve_schedule(args.schedule, result.shape.num_layers, optimised.devices)
    if (src / f"{OTHER}.json").exists():
        other = layout_mod.load(src / f"{OTHER}.json")
    else:  # the chain objective's (dtp:1's) layout from the same affinity, as schedule_experiment builds it
        chain = build_layouts(result, devices=optimised.devices, delta=1, restarts=args.restarts)[OPTIMISED]
        other = scored_layout(chain.with_name(OTHER), result, score_name="fo", objective="fo",
                              restarts=args.restarts, schedule=sched)
    made, report = intervene(result, optimised, other, args.schedule, args.layer)
    out = args.work / "layouts" / name
    out.mkdir(parents=True, exist_ok=True)
    for lay in (optimised.with_name(OPTIMISED), other, made[BROKEN], made[REPAIRED]):
        lay.save(out / f"{lay.name}.json")
    link = args.work / "affinity" / name
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink((args.source / "affinity" / name).resolve(), link)
    (args.work / "edge_intervention.json").write_text(json.dumps(report, indent=1))
    print(f"rule (fixed before the runs): {EDGE_RULE}")
    print(json.dumps(report["arms"], indent=1))
    return report


if __name__ == "__main__":
    main()
