"""Comparing layouts by their curves: when the candidate reaches the reference's KL, and the summary.

The paper's figures: the step at which the mean candidate curve first reaches the reference's final
KL, and per reference evaluation the compute multiplier (reference step over the candidate's
interpolated step to the same KL). Curves are means over seeds, on the steps every seed shares.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from models.distill.comparison.speedup import headline_text, reach_step, rule_speedup
from models.distill.records import EvalRecord, json_safe
from models.distill.spec import DistillSpec
from models.layouts.layout import Layout

SUMMARY_FORMAT = "dtp-layout-distill/1"


def multipliers(reference: tuple[Sequence[int], Sequence[float]],
                candidate: tuple[Sequence[int], Sequence[float]]) -> list[dict[str, float | None]]:
    """Per reference evaluation s > 0 with KL k: the candidate's interpolated step reaching k, and s over it."""
    ref_steps, ref_kls = reference
    rows: list[dict[str, float | None]] = []
    for s, k in zip(ref_steps, ref_kls, strict=True):
        if s == 0:
            continue
        reached = reach_step(candidate[0], candidate[1], k)
        mult = s / reached if reached else None  # reached at step 0 (or never): no finite multiplier
        rows.append({"step": s, "reference_kl": k, "candidate_step": reached, "multiplier": mult})
    return rows


def mean_curves(records: Sequence[EvalRecord]) -> dict[str, dict[str, Any]]:
    """Per layout: evaluation steps and the KL/ppl mean over seeds (steps all seeds share)."""
    by_layout: dict[str, dict[int, dict[int, EvalRecord]]] = {}
    for r in records:
        by_layout.setdefault(r.layout, {}).setdefault(r.seed, {})[r.step] = r
    curves = {}
    for name, seeds in by_layout.items():
        steps = sorted(set.intersection(*(set(v) for v in seeds.values())))
        per_seed = {str(seed): {"kl": [runs[s].kl for s in steps], "ppl": [runs[s].ppl for s in steps]}
                    for seed, runs in sorted(seeds.items())}  # str keys: the summary is JSON
        curves[name] = {
            "steps": steps,
            "kl": [float(np.mean([seeds[sd][s].kl for sd in seeds])) for s in steps],
            "ppl": [float(np.mean([seeds[sd][s].ppl for sd in seeds])) for s in steps],
            "kl_sd": [float(np.std([seeds[sd][s].kl for sd in seeds], ddof=1)) if len(seeds) > 1 else 0.0
                      for s in steps],
            "seeds": per_seed,
        }
    return curves


def seed_runs(curve: dict[str, Any]) -> list[list[tuple[float, float]]]:
    """A layout's per-seed curves [(step, kl)] (its mean curve alone where no seeds are kept)."""
    seeds = curve.get("seeds") or {"mean": {"kl": curve["kl"]}}
    return [list(zip(curve["steps"], s["kl"], strict=True)) for s in seeds.values()]


def headline(curves: dict[str, dict[str, Any]], *, reference: str, candidate: str) -> dict[str, Any] | None:
    """When `candidate` reaches `reference`'s final KL: `speedup`, per seed and its slowest (the schedule
    verdicts' rule, `rule_speedup`), and `said`, the sentence to show; the mean curves' step and multipliers
    per evaluation (the paper's figures) beside them, which carry no spread."""
    if reference not in curves or candidate not in curves:
        return None
    ref, cand = curves[reference], curves[candidate]
    final_step, final_kl = ref["steps"][-1], ref["kl"][-1]
    rows = multipliers((ref["steps"], ref["kl"]), (cand["steps"], cand["kl"]))
    speed = rule_speedup(seed_runs(ref), seed_runs(cand))
    head = {"reference": reference, "candidate": candidate,
            "reference_final_step": final_step, "reference_final_kl": final_kl,
            "candidate_final_kl": cand["kl"][-1],
            "candidate_step_to_reference_final_kl": reach_step(cand["steps"], cand["kl"], final_kl),
            "multipliers": rows,
            "speedup": {"slowest_seed": speed["speedup"], "fastest_seed": speed["max"], "seeds": speed["runs"],
                        "per_seed": speed["per_run"], "candidate_steps": speed["candidate_steps"],
                        "reference_step": speed["reference_step"], "applicable": speed["applicable"]}}
    return {**head, "said": headline_text(head)}


def summarise(records: Sequence[EvalRecord], *, spec: DistillSpec, dense_ppl: float, model_id: str,
              layouts: dict[str, Layout], seconds: float) -> dict[str, Any]:
    curves = mean_curves(records)
    return json_safe({
        "format": SUMMARY_FORMAT,
        "model": model_id,
        "devices": spec.devices,
        "delta": spec.delta,
        "schedule": str(spec.schedule),
        "world_size": spec.world_size,  # the ranks each run trained on (the curves do not depend on it)
        "seeds": list(spec.seeds),
        "recipe": spec.recipe.as_dict(),
        "train": asdict(spec.train),
        "eval": asdict(spec.eval),
        "dense_ppl": dense_ppl,
        "layouts": {name: {**curves[name], "J": (layouts[name].score or {}).get("J")}
                    for name in spec.layouts if name in curves},
        "headline": headline(curves, reference=spec.reference, candidate=spec.candidate),
        "seconds": round(seconds, 1),
    })


def summary_table(summary: dict[str, Any]) -> str:
    """KL and perplexity per layout at each evaluation, then the headline, as plain text."""
    layouts = summary["layouts"]
    if not layouts:
        return "no runs"
    steps = next(iter(layouts.values()))["steps"]
    lines = [f"{'layout':<16}{'J':>8}  " + "".join(f"{'KL@' + str(s):>10}" for s in steps)]
    for name, c in layouts.items():
        j = f"{c['J']:.2f}" if c.get("J") is not None else "-"
        lines.append(f"{name:<16}{j:>8}  " + "".join(f"{k:>10.4f}" for k in c["kl"]))
    lines.append(f"{'':<16}{'':>8}  " + "".join(f"{'ppl@' + str(s):>10}" for s in steps))
    for name, c in layouts.items():
        lines.append(f"{name:<16}{'':>8}  " + "".join(f"{p:>10.2f}" for p in c["ppl"]))
    lines.append(f"dense perplexity {summary['dense_ppl']:.3f}")
    head = summary.get("headline")
    if head:
        lines.append(headline_text(head))
        mults = [f"{r['step']}: " + (f"{r['multiplier']:.2f}×" if r["multiplier"] is not None else "—")
                 for r in head["multipliers"]]
        lines.append("compute multiplier per evaluation, mean curves (no spread): " + ", ".join(mults))
    return "\n".join(lines)


def iter_records(summary: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Flat (layout, seed, step, kl, ppl) rows of a summary, for tables."""
    for name, c in summary["layouts"].items():
        for seed, curve in c["seeds"].items():
            for s, kl, ppl in zip(c["steps"], curve["kl"], curve["ppl"], strict=True):
                yield {"layout": name, "seed": int(seed), "step": s, "kl": kl, "ppl": ppl}
