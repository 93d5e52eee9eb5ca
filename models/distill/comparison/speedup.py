"""How many times sooner a candidate layout reaches a reference's final KL, per seed, and the sentence that says
it: the one rule behind the schedule verdicts (bench/schedule_verdicts.py) and the product's headline (summary.json,
the dashboard, `dtp-layout client status`). Pure Python: the client and the API process import it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def reach_step(steps: Sequence[float], kls: Sequence[float], target: float) -> float | None:
    """First step at which the piecewise-linear curve (steps, kls) reaches KL ≤ target, else None."""
    for i, (s, k) in enumerate(zip(steps, kls, strict=True)):
        if k <= target:
            if i == 0:
                return float(s)
            s0, k0 = steps[i - 1], kls[i - 1]
            return float(s0 + (k0 - target) / (k0 - k) * (s - s0))
    return None


def mean_of_runs(runs: Sequence[Sequence[tuple[float, float]]]) -> list[tuple[float, float]]:
    """The runs' KL averaged at the steps every run evaluated: [(step, mean kl)]."""
    by_run = [dict(run) for run in runs]
    steps = sorted(set.intersection(*(set(r) for r in by_run)))
    return [(s, sum(r[s] for r in by_run) / len(by_run)) for s in steps]


def rule_speedup(reference: Sequence[Sequence[tuple[float, float]]],
                 candidate: Sequence[Sequence[tuple[float, float]]]) -> dict[str, Any]:
    """How many times sooner each candidate run reaches the reference's final KL, as the schedule verdicts'
    rule (bench/schedule_verdicts.py) and the headline count it.

    reference, candidate: runs (layouts × seeds), each [(step, kl)] in step order. The target is the
    reference's mean curve at its last step (its runs' final KL averaged); the reference's step is where
    that mean curve first reaches it and each candidate run's step where its own curve does, both linearly
    interpolated between evaluations (a grid of evaluations every 10 of 50 steps would otherwise allow
    only 5, 2.5, 1.67 and 1.25×). Per run: reference step / run step; inf for a run at the target before
    training, 0 for one that never reaches it. `speedup` is the slowest run's. Not `applicable` (speedup
    None) when the reference's mean curve is at the target at step 0: 0 steps against 0 steps says nothing.
    """
    ref_curve = mean_of_runs(reference)
    target = ref_curve[-1][1]
    ref_step = reach_step([s for s, _ in ref_curve], [k for _, k in ref_curve], target)
    assert ref_step is not None  # the mean curve's last point is the target itself
    steps = [reach_step([s for s, _ in run], [k for _, k in run], target) for run in candidate]
    applicable = ref_step > 0
    per_run = [(ref_step / s if s else math.inf) if s is not None else 0.0 for s in steps] if applicable else []
    return {"target_kl": target, "reference_step": ref_step, "candidate_steps": steps, "applicable": applicable,
            "per_run": per_run, "speedup": min(per_run) if per_run else None,
            "max": max(per_run) if per_run else None, "runs": len(candidate)}


def headline_text(head: dict[str, Any]) -> str:
    """The headline as one sentence: the slowest seed's speedup with the seeds' range, or "one seed"."""
    ref, cand, speed = head["reference"], head["candidate"], head.get("speedup")
    target = f"{ref}'s final KL {head['reference_final_kl']:.4g} (step {head['reference_final_step']})"
    if speed is None:  # a summary written before the per-seed speedup: its mean curves only
        reach = head["candidate_step_to_reference_final_kl"]
        return (f"{cand}'s mean curve reaches {target} at step {reach:.3g} (mean over seeds, no spread)."
                if reach is not None else f"{cand}'s mean curve does not reach {target}.")
    if not speed["applicable"]:
        return f"{ref} is at its own final KL at step 0: training did not lower it, so there is no speedup to give."
    steps = speed["candidate_steps"]
    if any(s is None for s in steps):
        return f"{cand} does not reach {target} in {sum(s is None for s in steps)} of {len(steps)} seed(s)."
    if all(s == 0 for s in steps):
        return f"{cand} is at {target} before training, in every seed."
    low, high, n = speed["slowest_seed"], speed["fastest_seed"], speed["seeds"]
    fastest = "∞ (at it before training)" if high is None or math.isinf(high) else f"{high:.2f}×"
    spread = "one seed" if n == 1 else f"slowest of {n} seeds; the seeds {low:.2f}×–{fastest}"
    return f"{cand} reaches {target} by step {max(steps):.3g}: {low:.2f}× fewer steps ({spread})."
