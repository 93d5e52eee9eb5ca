"""Issue 29: is J_σ's misranking of layouts the first position's doing?

Diagnosis (bench/joint_damage.py's per-position output, SmolLM2-135M, dtp:2): the first position of each
1,024-token calibration block — one token in 1,024 — carries 46–74 % of the FFNs' first-order damage of
the four dtp:2 layouts (random: 419k of 565k). That is the first position's massive activations (the
attention sink every block starts with), and the affinity means inherit it: a few edges whose weight is
mostly one token dominate J_σ's weights. Training sees that position as one of 64 in a block.

This script rescores the recorded arms' layouts (unchanged) with J_σ on an affinity whose means leave out
each calibration block's first `--skip-positions` positions (`affinity_pass(..., skip_positions=k)`), and
counts the separated pairs it orders against the same counts for today's J_σ.

Rule fixed before its first run (2026-12-05, committed with this script): the skipped-position J_σ ranks
better than J_σ only if it orders more of the recorded separated pairs (every seed of one arm ending below
every seed of the other) over all the sets given, and none fewer in any set; it "ranks the other-schedule
layout" only if it orders every separated pair of both dtp:2 four-arm sets (the 30-layer and the 2-layer).

    OMP_NUM_THREADS=1 .venv/bin/python bench/objective_positions.py \
        --set "var/jd dtp:2 docs/schedules_other_dtp2.json" --set "var/jd-edge dtp:2 docs/schedules_edge_dtp2.json"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RULE = ("the skipped-position J_σ ranks better than J_σ only if it orders more of the recorded separated pairs "
        "over all the sets and none fewer in any set; it ranks the other-schedule layout only if it orders every "
        "separated pair of both dtp:2 four-arm sets")


def pairs_ordered(predicted: dict[str, float], finals: dict[str, list[float]]) -> tuple[int, int, list[str]]:
    """(ordered, separated, the misordered pairs as 'better<worse') of a predictor (higher: better)."""
    from bench.schedule_experiment import ranking

    rows = ranking(predicted, finals)
    return (sum(r["agrees"] for r in rows), len(rows),
            [f"{r['better']}<{r['worse']}" for r in rows if not r["agrees"]])


def score_set(work: str, schedule: str, results: str, extra: list[str], skip: int) -> dict[str, Any]:
    from bench.schedule_experiment import RECORDED_SETS
    from bench.schedule_experiment import parse_args as experiment_args
    from bench.schedule_experiment_runs import Experiment, slug
    from models.affinity.edges import schedule_affinity_pass
    from models.affinity.file import AffinityResult

    experiment = Experiment(experiment_args(["--work", work, "--schedules", schedule, "--other", "", *RECORDED_SETS,
                                             *extra]))
    sched = experiment.schedule(schedule)
    path = Path(work) / f"affinity-skip{skip}" / slug(schedule) / "affinity.safetensors"
    if not path.exists():
        result = schedule_affinity_pass(experiment.model, experiment.blocks(), schedule=sched, batch_size=1,
                                        skip_positions=skip)
        path.parent.mkdir(parents=True, exist_ok=True)
        result.save(path)
    today = experiment.predictors(schedule)
    skipped = experiment.predictors(schedule, AffinityResult.load(path))
    predicted = {**today, **{f"{name}_skip": values for name, values in skipped.items()}}
    finals = json.loads(Path(results).read_text())["final_kl"]
    finals = {arm: kls for arm, kls in finals.items() if arm in predicted["J_damage"]}
    return {"work": work, "schedule": schedule, "results": results, "predicted": predicted, "final_kl": finals,
            "ordered": {p: pairs_ordered(values, finals) for p, values in predicted.items()}}


TRAIN_RULE = ("per schedule, the layout optimised on the skipped-position J_σ trains better than the one optimised "
              "on J_σ only if every seed of it ends below every seed of the recorded J_σ-optimised arm (the same "
              "recipe, seeds and data), worse only if every seed ends above; otherwise no difference is shown")


def train_skip_arm(work: str, schedule: str, skip: int, extra: list[str]) -> dict[str, Any]:
    """The layout optimised on the skipped-position J_σ (the experiment's optimiser and restarts), written as
    `optimised-skip<k>` into WORK/layouts/<σ>/ and distilled under σ with the experiment's recipe and seeds;
    only that arm is trained. Returns its per-seed final KLs, second-domain KLs and curves."""
    from bench.schedule_experiment import RECORDED_SETS
    from bench.schedule_experiment import parse_args as experiment_args
    from bench.schedule_experiment_runs import Experiment, slug
    from models.affinity.file import AffinityResult
    from models.variants.set import build_layouts

    experiment = Experiment(experiment_args(["--work", work, "--schedules", schedule, "--other", "", *RECORDED_SETS,
                                             *extra]))
    sched = experiment.schedule(schedule)
    arm = f"optimised-skip{skip}"
    layouts = Path(work) / "layouts" / slug(schedule)
    if not (layouts / f"{arm}.json").exists():
        result = AffinityResult.load(Path(work) / f"affinity-skip{skip}" / slug(schedule) / "affinity.safetensors")
        made = build_layouts(result, devices=experiment.args.devices, delta=1, restarts=experiment.args.restarts,
                             schedule=sched)["optimised"]
        made.with_name(arm, made.score).save(layouts / f"{arm}.json")
    curves, secondary = experiment.train(schedule, arms=[arm])  # this arm only
    return {"arm": arm, "final_kl": [c[-1][1] for _, c in sorted(curves[arm].items())],
            "final_kl_second_domain": secondary[arm], "curves": curves[arm]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", action="append", required=True,
                    help='"WORK SCHEDULE RESULTS.json [experiment flags...]": a work directory whose layouts were '
                         "trained, and the result file with their final KLs")
    ap.add_argument("--skip-positions", type=int, default=1)
    ap.add_argument("--train", action="store_true", help="also build and train each set's skipped-position-optimised "
                    "arm (the experiment's recipe; the set's extra flags choose seeds and budget)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    print(f"rule (fixed before the first run): {RULE}", flush=True)
    sets = []
    for spec in args.set:
        work, schedule, results, *extra = spec.split()
        row = score_set(work, schedule, results, extra, args.skip_positions)
        sets.append(row)
        if args.train:
            print(f"training rule (fixed before the runs): {TRAIN_RULE}", flush=True)
            row["trained"] = train_skip_arm(work, schedule, args.skip_positions, extra)
            print(f"{work} {schedule}: {row['trained']['arm']} final KL {row['trained']['final_kl']}", flush=True)
        print(f"{work} {schedule}: " + "; ".join(f"{p} {o}/{n}" + (f" (misorders {', '.join(bad)})" if bad else "")
                                                  for p, (o, n, bad) in row["ordered"].items()), flush=True)
    out = {"rule": RULE, "skip_positions": args.skip_positions, "sets": sets}
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
