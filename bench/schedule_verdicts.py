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

import argparse
import json
import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.distill.comparison.speedup import rule_speedup
from models.distill.records import json_safe

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
    """The arm a layout of the experiment belongs to, by its name: `optimised`, `optimised-seed<N>` (another
    optimiser seed) or `optimised-calib<N>` (another calibration subset), `contiguous`, `random-<seed>`; anything
    else (optimised-other, an intervention) is OTHER."""
    if re.fullmatch(r"optimised(-(seed|calib)\d+)?", layout):
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


# ---- the speedup across budgets (issue 45 item 3: does dtp:1's speedup grow from 50 to 200 steps?) --------------
# Fixed before the first 200-step run. Each budget's speedups are the amended rule's, per optimised run
# (interpolated, to contiguous's own final KL at that budget), so the two budgets' ranges are compared whole.

GROWS, SHRINKS, UNRESOLVED = "grows", "shrinks", "no change resolved"
GROWTH_RULE = ('from the shorter budget to the longer the speedup "grows" where the slowest optimised run\'s '
               'speedup at the longer exceeds the fastest one\'s at the shorter, "shrinks" where the fastest at '
               'the longer is below the slowest at the shorter, otherwise "no change resolved"; both budgets need '
               "the amended rule's layouts (2 optimised, 2 random) and a speedup that applies")
PAPER_SPEEDUP = 2.9  # the paper's dtp:1 figure (Qwen3-0.6B, about 16M distillation tokens)


def growth(short: Sequence[Run], long: Sequence[Run]) -> dict[str, Any]:
    """GROWTH_RULE on one schedule's runs at two budgets (`short` the fewer steps)."""
    said = {"short": amended_verdict(short), "long": amended_verdict(long)}
    for budget in ("short", "long"):
        if said[budget]["verdict"] in (NOT_APPLICABLE, NOT_DECIDED):
            return {"verdict": NOT_DECIDED, "why": f"the {budget}er budget is {said[budget]['verdict']}"}
    (s_low, s_high), (l_low, l_high) = said["short"]["speedup_range"], said["long"]["speedup_range"]
    verdict = GROWS if l_low > s_high else SHRINKS if l_high < s_low else UNRESOLVED
    return {"verdict": verdict, "short_range": [s_low, s_high], "long_range": [l_low, l_high],
            "paper_speedup": PAPER_SPEEDUP, "long_reaches_paper": l_low >= PAPER_SPEEDUP,
            "why": f"runs {times(s_low)}–{times(s_high)} at the shorter budget, {times(l_low)}–{times(l_high)} "
                   f"at the longer"}


# ---- the runs behind the verdicts, as committed files --------------------------------------------------------

RUNS_FORMAT = "dtp-layout-schedule-runs/1"
RUNS_DIR = Path(__file__).resolve().parent.parent / "docs" / "schedule_runs"
# The verdict table of docs/schedules.md: every layout-dependent schedule at 50 steps, dtp:2 and pt:4 also at 100,
# dtp:1 also at 200 (does its speedup grow with the budget?).
TABLE = (*((s, 50) for s in ("dtp:1", "dtp:2", "pt:2", "pt:4", "dtp:1@15", "spd:auto:8")),
         ("dtp:2", 100), ("pt:4", 100), ("dtp:1", 200))
LOST = "raw runs not in the repository: re-run needed"


def slug(schedule: str) -> str:
    """A schedule as a file name: `dtp:1@15` → `dtp-1at15`."""
    return schedule.replace(":", "-").replace(",", "_").replace("@", "at")


def runs_file(runs_dir: Path, schedule: str, steps: int) -> Path:
    return runs_dir / f"{slug(schedule)}-{steps}steps.json"


def runs_text(schedule: str, steps: int, runs: Sequence[Run], **about: Any) -> str:
    """The file: what ran (`about`: resolved schedule, setup, source), then one line per run."""
    head = {"format": RUNS_FORMAT, "schedule": schedule, "steps": steps, **about}
    lines = [json.dumps({"arm": r.arm, "layout": r.layout, "seed": r.seed, "primary": [list(p) for p in r.primary],
                         "second": [list(p) for p in r.second]}) for r in runs]
    return json.dumps(head, indent=1)[:-2] + ',\n "runs": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n"


def write_runs(path: Path, schedule: str, steps: int, runs: Sequence[Run], **about: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(runs_text(schedule, steps, runs, **about))


def load_runs(path: Path) -> tuple[dict[str, Any], list[Run]]:
    """(the file's header, its runs); ValueError naming the file for another format."""
    doc = json.loads(path.read_text())
    if doc.get("format") != RUNS_FORMAT:
        raise ValueError(f"{path}: format {doc.get('format')!r}, expected {RUNS_FORMAT!r}")
    runs = [Run(r["arm"], r["layout"], int(r["seed"]), tuple((int(s), float(k)) for s, k in r["primary"]),
                tuple((int(s), float(k)) for s, k in r["second"])) for r in doc.pop("runs")]
    return doc, runs


def spread(values: Sequence[float]) -> str:
    """Mean and the range, as docs/schedules.md prints them: `1.343 (1.340–1.348)`."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ({min(values):.3f}–{max(values):.3f})"


def registered_verdict(runs: Sequence[Run]) -> dict[str, Any] | None:
    """Issue 29's registered rule (bench/schedule_experiment.py `verdict`) on the same runs, by layout name."""
    from bench.schedule_experiment import verdict

    curves: dict[str, dict[int, list[tuple[int, float]]]] = {}
    for r in runs:
        curves.setdefault(r.layout, {})[r.seed] = list(r.primary)
    return verdict(curves) if {OPTIMISED, CONTIGUOUS} <= curves.keys() else None


def table_row(schedule: str, steps: int, runs_dir: Path, path: Path | None = None) -> dict[str, Any]:
    """One row of the verdict table, from its runs file alone (LOST where the file is not there)."""
    path = path or runs_file(runs_dir, schedule, steps)
    row: dict[str, Any] = {"schedule": schedule, "steps": steps, "file": path.name}
    if not path.exists():
        return {**row, "verdict": LOST}
    about, runs = load_runs(path)
    said = amended_verdict(runs)
    arms = by_arm(runs)
    finals = {arm: [r.final for r in rs] for arm, rs in arms.items() if rs and arm != OTHER}
    second = {arm: [r.second[-1][1] for r in rs if r.second] for arm, rs in arms.items() if rs and arm != OTHER}
    return {**row, "resolved": about.get("resolved", schedule), "verdict": said["verdict"], "why": said["why"],
            "counts": said["counts"], "speedup": said.get("speedup"), "speedup_range": said.get("speedup_range"),
            "final_kl": finals, "final_kl_second_domain": second, "registered": registered_verdict(runs)}


def verdict_table(runs_dir: Path = RUNS_DIR) -> list[dict[str, Any]]:
    """docs/schedules.md's rows (TABLE), then a row for every other runs file in `runs_dir`."""
    rows = [table_row(schedule, steps, runs_dir) for schedule, steps in TABLE]
    listed = {runs_file(runs_dir, schedule, steps) for schedule, steps in TABLE}
    for path in sorted(set(runs_dir.glob("*steps.json")) - listed):
        about, _ = load_runs(path)
        rows.append(table_row(about["schedule"], int(about["steps"]), runs_dir, path))
    for row in rows:  # a budget longer than the schedule's shortest: GROWTH_RULE against that one
        shorter = [r for r in rows if r["schedule"] == row["schedule"] and r["steps"] < row["steps"]
                   and r["verdict"] != LOST]
        if row["verdict"] != LOST and shorter:
            short = min(shorter, key=lambda r: r["steps"])
            row["growth"] = {"from_steps": short["steps"], **growth(load_runs(runs_dir / short["file"])[1],
                                                                    load_runs(runs_dir / row["file"])[1])}
    return rows


def speedup_spread(row: dict[str, Any]) -> str:
    """The rule's speedup (the slowest optimised run) with the range over runs, or why there is none."""
    speed: list[float] | None = row.get("speedup_range")
    if not speed or speed[0] is None:
        return "–"
    low, high = speed
    runs = row["counts"][OPTIMISED]["runs"]
    if runs == 1:
        return f"{times(low)} (one run)"
    return f"{times(low)} (runs {times(low)}–{times(high)}, {runs} runs)"


def times(speedup: float) -> str:
    """`1.57×`; a run at the target before training is unbounded, not a number."""
    return "∞ (at the target before training)" if math.isinf(speedup) else f"{speedup:.2f}×"


def table_text(rows: Sequence[dict[str, Any]]) -> str:
    """The table as text: one line per schedule and budget."""
    lines = [f"amended rule: {AMENDED_RULE}", ""]
    for row in rows:
        head = f"{row['schedule']} at {row['steps']} steps: {row['verdict']}"
        if row["verdict"] == LOST:
            lines.append(f"{head} ({row['file']} missing)")
            continue
        n = row["counts"]
        arms = ", ".join(f"{arm} {c['layouts']} layout(s) × {c['seeds']} seed(s)" for arm, c in n.items())
        finals = "; ".join(f"{arm} {spread(v)}" for arm, v in row["final_kl"].items())
        old = row["registered"]
        lines += [head + f" ({row['why']})", f"  {arms}", f"  final KL, primary: {finals}",
                  f"  speedup to contiguous's final KL, interpolated: {speedup_spread(row)}",
                  f"  the registered rule on these runs: {old['verdict']}, "
                  f"{'undefined' if old['speedup'] is None else format(old['speedup'], '.2f') + '×'} on the grid"
                  if old else "  the registered rule: no optimised or contiguous run"]
        if "growth" in row:
            grown = row["growth"]
            lines.append(f"  the speedup from {grown['from_steps']} steps: {grown['verdict']} ({grown['why']})")
    return "\n".join([*lines, "", f"across budgets: {GROWTH_RULE}"])


def verdicts_main(argv: Sequence[str]) -> list[dict[str, Any]]:
    """`python -m bench.schedule_experiment verdicts [--json] [--runs DIR]`: the table from the runs files."""
    ap = argparse.ArgumentParser(prog="python -m bench.schedule_experiment verdicts",
                                 description="The verdict table recomputed from the committed runs files alone.")
    ap.add_argument("--json", action="store_true", help="one JSON object per schedule and budget, in a list")
    ap.add_argument("--runs", type=Path, default=RUNS_DIR, help="the runs files' folder (default docs/schedule_runs)")
    args = ap.parse_args(list(argv))
    rows = verdict_table(args.runs)
    print(json.dumps(json_safe(rows), indent=1) if args.json else table_text(rows))
    return rows
