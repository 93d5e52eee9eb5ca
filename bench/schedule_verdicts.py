"""The schedule experiment's verdict rule, amended (issue 45) before any run under it.

Issue 29 registered the first rule (bench/schedule_experiment.py `verdict`: one layout per arm, the speedup
read on the evaluation grid). The audit found that rule could call a schedule "helps" on a 0/0 speedup
(spd:auto:8, where training makes every arm worse), that with evaluations every 10 of 50 steps "≥ 1.5×"
meant "≥ 1.67×", and that one layout stood for each arm. The amended rule, fixed here before its first run:

- the unit is a run: one layout trained with one seed. An arm is every layout of its kind (optimised for the
  schedule, contiguous, random), each trained with every seed;
- "not applicable at this budget" where contiguous's mean curve is already at its own final KL at step 0, or
  where training lowers no arm's mean KL (a case of the first: contiguous's mean KL then does not fall below
  its value at step 0): no speedup is measured there, so nothing "helps";
- "not decided" with fewer than 2 optimised layouts (different optimiser restart seeds or calibration subsets)
  or fewer than 2 random layouts: one layout cannot stand for its arm (rebuilt layouts moved 0.01–0.08 nats);
- "helps" only if every optimised run ends below every contiguous and every random run (final KL, primary
  evaluation) and every optimised run reaches contiguous's final KL (its runs' mean) at least 1.5× sooner
  than contiguous's mean curve does, both read by linear interpolation between evaluations
  (`models.distill.comparison.report.rule_speedup`);
- otherwise "not shown at this budget".
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from models.distill.comparison.report import rule_speedup

AMENDED_RULE = ('"helps" only with at least 2 optimised layouts (different optimiser restart seeds or calibration '
                "subsets) and 2 random layouts, every optimised run (layout x training seed) ending below every "
                "contiguous and random run, and every optimised run reaching contiguous's final KL (mean over its "
                "runs) at least 1.5x sooner than contiguous's mean curve, steps linearly interpolated between "
                'evaluations; "not applicable at this budget" where contiguous is at that KL at step 0 or training '
                'lowers no arm; "not decided" with fewer layouts; otherwise "not shown at this budget"')
SPEEDUP = 1.5
MIN_LAYOUTS = 2  # of the optimised arm and of the random arm
OPTIMISED, CONTIGUOUS, RANDOM, OTHER = "optimised", "contiguous", "random", "other"
HELPS, NOT_SHOWN = "helps", "not shown at this budget"
NOT_APPLICABLE, NOT_DECIDED = "not applicable at this budget", "not decided"

Curve = tuple[tuple[int, float], ...]  # [(step, kl)] in step order


@dataclass(frozen=True)
class Run:
    """One layout trained under the schedule with one seed: its KL at each evaluation on both domains."""

    arm: str  # OPTIMISED, CONTIGUOUS, RANDOM or OTHER (an extra arm the verdict does not read)
    layout: str
    seed: int
    primary: Curve
    second: Curve = ()  # the second domain (the runs of issue 29 evaluated it after the last step only)

    @property
    def final(self) -> float:
        return self.primary[-1][1]


def arm_of(layout: str) -> str:
    """The arm a layout of the experiment belongs to, by its name: `optimised` or `optimised-seed<N>` (another
    optimiser seed), `contiguous`, `random-<seed>`; anything else (optimised-other, an intervention) is OTHER."""
    if re.fullmatch(r"optimised(-seed\d+)?", layout):
        return OPTIMISED
    if layout == CONTIGUOUS:
        return CONTIGUOUS
    return RANDOM if re.fullmatch(r"random-\d+", layout) else OTHER


def by_arm(runs: Sequence[Run]) -> dict[str, list[Run]]:
    out: dict[str, list[Run]] = {OPTIMISED: [], CONTIGUOUS: [], RANDOM: []}
    for run in runs:
        out.setdefault(run.arm, []).append(run)
    return out


def lowered(runs: Sequence[Run]) -> bool:
    """Training lowered this arm: its runs' mean final KL is below their mean KL at step 0."""
    return statistics.fmean(r.final for r in runs) < statistics.fmean(r.primary[0][1] for r in runs)


def counts(arms: dict[str, list[Run]]) -> dict[str, dict[str, int]]:
    """Per arm: how many layouts, seeds and runs."""
    return {arm: {"layouts": len({r.layout for r in runs}), "seeds": len({r.seed for r in runs}), "runs": len(runs)}
            for arm, runs in arms.items() if arm != OTHER}


def amended_verdict(runs: Sequence[Run]) -> dict[str, Any]:
    """The amended rule (AMENDED_RULE) on a schedule's runs."""
    arms = by_arm(runs)
    opt, cont, rand = arms[OPTIMISED], arms[CONTIGUOUS], arms[RANDOM]
    said: dict[str, Any] = {"counts": counts(arms)}
    if not opt or not cont:
        return {**said, "verdict": NOT_DECIDED, "why": "no optimised or no contiguous run"}
    speed = rule_speedup([r.primary for r in cont], [r.primary for r in opt])
    below = max(r.final for r in opt) < min(r.final for r in cont + rand)
    trained = {arm: lowered(rs) for arm, rs in arms.items() if rs and arm != OTHER}
    said |= {"below_every_baseline_run": below, "target_kl": speed["target_kl"],
             "contiguous_reaches_at": speed["reference_step"], "optimised_reach_at": speed["candidate_steps"],
             "speedup": speed["speedup"], "speedup_range": [speed["speedup"], speed["max"]],
             "training_lowered": trained}
    layouts = said["counts"]
    if not speed["applicable"]:  # contiguous not lowered by training; where no arm is, this is the case too
        return {**said, "verdict": NOT_APPLICABLE,
                "why": f"contiguous's mean curve is at its final KL {speed['target_kl']:.3f} at step 0; training "
                       f"lowers {', '.join(a for a, down in trained.items() if down) or 'no arm'}"}
    if layouts[OPTIMISED]["layouts"] < MIN_LAYOUTS or layouts[RANDOM]["layouts"] < MIN_LAYOUTS:
        return {**said, "verdict": NOT_DECIDED,
                "why": f"{layouts[OPTIMISED]['layouts']} optimised and {layouts[RANDOM]['layouts']} random "
                       f"layout(s); the rule needs {MIN_LAYOUTS} of each"}
    fast = speed["speedup"] >= SPEEDUP
    if below and fast:
        return {**said, "verdict": HELPS, "why": f"every optimised run below every baseline run, "
                                                 f"slowest at {speed['speedup']:.2f}x"}
    why = [] if below else ["an optimised run ends at or above a baseline run"]
    why += [] if fast else [f"the slowest optimised run is {speed['speedup']:.2f}x, under {SPEEDUP}x"]
    return {**said, "verdict": NOT_SHOWN, "why": "; ".join(why)}
