"""Issue 45 item 5: does a one-step look-ahead rank the dtp:2 layouts as they train, where the damage scores do not?

Every score tried so far (J_σ, the missing and joint FFN damage, the unabsorbed damage of
bench/repairable_damage.py, the step-0 KL) measures how *large* a layout's damage is in the untrained DTP
model, and none orders both dtp:2 four-arm sets (docs/schedules.md, "What this leaves"). The recorded curves
say the order is settled within the first 10 steps: it depends on how fast training repairs a layout's
damage. This script tries the simplest gradient-aware score of the untrained model: take one optimiser step
of the product's own distillation step and see where it lands.

For each arm's layout: the untrained DTP student (`models.distill.student.make_student`), its KL(dense ‖ DTP)
on the scoring blocks (step-0 KL), one `models.distill.train.train_step` with `make_optimizer` on one fixed
training batch (the same for every arm), and the KL again. Scores (lower KL: better):

    look-ahead KL   KL after the one step                       the candidate the rule judges
    drop            step-0 KL − look-ahead KL                   a second candidate, by the same rule
    step-0 KL       KL before the step                          recorded (it misordered the 30-layer set)

The step is the experiment's recipe (its lr, betas, clipping, CE weight, batch size and sequence length) at
its *peak* lr with no warm-up: the recorded runs warm up over max(1, steps // 10) steps (the 30-layer set's
first step ran at lr / 5, the 2-layer set's at lr), while the look-ahead asks what one full step does. The
batch is the experiment's first `batch_size` training blocks in the text's order (where training places them,
after the set's calibration) moved past the scoring blocks, so that the KL after the step is read on text the
step did not see. The first AdamW step from a zero state is ≈ lr · sign(g) per weight (m̂ = g, v̂ = g²), so clipping
barely changes it: the look-ahead measures how far a sign step of size lr moves each layout.

Rule fixed before its first run (2026-12-06, committed with this script, before any real set was scored):
RULE below, and DROP_RULE for the drop. Both sets are scored on the same 8 × 1,024 tokens of `corpus:kjv`
(the 30-layer set's calibration text; the 2-layer set calibrated on 4 × 128 of them). The result covers the
scores tried, not every score of the untrained model.

Cost on one core (measured 2026-12-06, a random layout, dtp:2, L = 3): 36 s a layout on the 2-layer model at
8 × 1,024 scoring tokens; 24 s on the 30-layer model at 1 × 1,024, so about 2.5 min a layout at 8 × 1,024 (two
evaluations of the student and one step; the dense reference once per set, ≈ 30 s). The real run (the lead's):
first the 2-layer set's four arms × three seeds (docs/schedules.md's command, with the recorded sets' one
optimised and one random layout, since the experiment's defaults now build two of each):

    .venv/bin/python bench/schedule_experiment.py --layers 2 --schedules dtp:2 --other dtp:1 --devices 3 \\
        --calib-sequences 4 --calib-seq-len 128 --eval corpus:shakespeare --eval-blocks 8 --eval2-blocks 2 \\
        --seq-len 64 --batch-size 2 --steps 10 --eval-every 5 --restarts 1 --seeds 0,1,2 \\
        --optimised-layouts 1 --random-layouts 1 --work var/jd-2l

then the two sets, one pinned process each (the 2-layer set's flags repeat its recipe: batch 2 of 64 tokens):

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python bench/lookahead_score.py --set "var/jd-2l dtp:2 \\
        var/jd-2l/result-dtp-2.json --other dtp:1 --layers 2 --devices 3 --calib-sequences 4 --calib-seq-len 128 \\
        --seq-len 64 --batch-size 2 --steps 10 --eval-every 5 --restarts 1" --out var/la-2l.json
    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python bench/lookahead_score.py \\
        --set "var/jd dtp:2 docs/schedules_other_dtp2.json --other dtp:1" --out var/la-30.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RULE = ("the one-step look-ahead KL ranks the layouts only if it orders every separated pair of both dtp:2 "
        "four-arm sets (30-layer and 2-layer), scored on the same 8 x 1,024 corpus:kjv tokens; otherwise it is "
        "rejected")
DROP_RULE = ("the one-step KL drop (step-0 KL minus look-ahead KL) ranks the layouts only if it orders every "
             "separated pair of both dtp:2 four-arm sets (30-layer and 2-layer), scored on the same 8 x 1,024 "
             "corpus:kjv tokens; otherwise it is rejected")
CANDIDATES = ("lookahead_kl", "drop")  # what the two rules judge; the others are recorded beside them


def peak_step_recipe(recipe: Any) -> Any:
    """The recipe whose step 0 runs at its peak lr: no warm-up (the cosine decay starts at lr)."""
    from models.distill.schedule import learning_rate

    out = dataclasses.replace(recipe, warmup_steps=0)
    assert learning_rate(0, out) == recipe.lr
    return out


def lookahead(teacher: Any, layout: Any, schedule: Any, recipe: Any, batch: torch.Tensor,
              reference: Any) -> dict[str, float]:
    """One layout's look-ahead: {kl_before, kl_after, drop, grad_norm (before clipping), lr, train_loss,
    train_kl}. `recipe` is used as given (`peak_step_recipe` makes the script's); batch: [B, S] token ids;
    reference: the dense model on the scoring blocks (`DenseReference`)."""
    from models.distill.evaluation import evaluate_student
    from models.distill.student import make_student
    from models.distill.train import make_optimizer, train_step

    device = next(teacher.parameters()).device
    student = make_student(teacher, layout, recipe, schedule).to(device)
    kl_before, _ = evaluate_student(student, teacher, reference, recipe=recipe)
    stats = train_step(student, teacher, batch.to(device), make_optimizer(student, recipe), step=0, recipe=recipe)
    kl_after, _ = evaluate_student(student, teacher, reference, recipe=recipe)
    return {"kl_before": kl_before, "kl_after": kl_after, "drop": kl_before - kl_after,
            "grad_norm": stats.grad_norm, "lr": stats.lr, "train_loss": stats.loss, "train_kl": stats.kl}


def batch_spec(experiment: Any, schedule: str, scoring: Any) -> Any:
    """The look-ahead's batch: the experiment's first batch_size training blocks in the text's order, where
    training places them (after the set's calibration), moved past the scoring blocks where they share a text."""
    from bench.schedule_experiment import OPTIMISED
    from models.data.heldout import part
    from models.distill.data import place_data

    placed = place_data(experiment.distill_spec(schedule, OPTIMISED, 0)).train
    assert placed is not None  # a distillation always has training blocks
    train = part("train", dataclasses.replace(placed, sequences=experiment.args.batch_size, seed=0))
    before = [part("calibration", experiment.calibration), part("scoring", scoring)]
    while clash := [p for p in before if train.overlap(p)]:  # forward only: ends
        train = train.after(max(p.span[1] for p in clash))
    return train.spec


def score_set(work: str, schedule: str, results: str, extra: list[str], scoring: Any | None) -> dict[str, Any]:
    """Every arm of WORK's σ layouts scored by its look-ahead on `scoring` (a `CalibrationSpec`; None: the set's
    calibration), against the trained final KLs in RESULTS."""
    from bench.objective_positions import pairs_ordered
    from bench.schedule_experiment import RECORDED_SETS
    from bench.schedule_experiment import parse_args as experiment_args
    from bench.schedule_experiment_runs import Experiment
    from models.data.calibration import load_blocks
    from models.distill.evaluation import DenseReference
    from models.layouts import layout as layout_mod
    from models.schedules.grammar import parse_schedule

    experiment = Experiment(experiment_args(["--work", work, "--schedules", schedule, *RECORDED_SETS, *extra]))
    vocab = int(experiment.model.config.vocab_size)
    scoring = scoring or experiment.calibration
    recipe = peak_step_recipe(experiment.recipe())
    spec = batch_spec(experiment, schedule, scoring)
    batch = load_blocks(spec, experiment.tokenizer, vocab_size=vocab)  # [batch_size, seq_len]
    reference = DenseReference.compute(experiment.model, load_blocks(scoring, experiment.tokenizer, vocab_size=vocab),
                                       recipe=recipe)  # once per set: the dense model on the scoring blocks
    sched = parse_schedule(experiment.resolved(schedule))
    predicted = experiment.predictors(schedule)
    rows: dict[str, dict[str, Any]] = {}
    for arm in experiment.arms(schedule):
        t0 = time.perf_counter()
        lay = layout_mod.load(experiment.layouts(schedule) / f"{arm}.json")
        rows[arm] = {**lookahead(experiment.model, lay, sched, recipe, batch, reference),
                     "seconds": time.perf_counter() - t0}
        r = rows[arm]
        print(f"{work} {schedule} {arm}: J_damage {predicted['J_damage'][arm]:.3f} step-0 KL {r['kl_before']:.4f} "
              f"look-ahead KL {r['kl_after']:.4f} (drop {r['drop']:.4f}, grad norm {r['grad_norm']:.4g}, "
              f"{r['seconds']:.0f} s)", flush=True)
    finals = json.loads(Path(results).read_text())["final_kl"]
    finals = {arm: kls for arm, kls in finals.items() if arm in rows}
    scores = {"J_damage": predicted["J_damage"],  # higher: predicted better, as pairs_ordered reads them
              "lookahead_kl": {arm: -r["kl_after"] for arm, r in rows.items()},
              "drop": {arm: r["drop"] for arm, r in rows.items()},  # a larger drop: repaired faster
              "step0_kl": {arm: -r["kl_before"] for arm, r in rows.items()}}
    ordered = {name: pairs_ordered(values, finals) for name, values in scores.items()}
    return {"work": work, "schedule": schedule, "results": results, "batch": dataclasses.asdict(spec),
            "lr": recipe.lr, "dense_ppl": reference.dense_ppl, "arms": rows, "final_kl": finals, "ordered": ordered,
            "orders_every_pair": {name: not bad for name, (_, _, bad) in ordered.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from bench.score_sets import add_set_args, score_sets, scoring_of

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_set_args(ap, '"WORK SCHEDULE RESULTS.json [experiment flags...]": a work directory whose layouts were '
                     "trained, the result file with their final KLs, and the flags of the experiment that "
                     "trained them (its recipe is the look-ahead's)")
    args = ap.parse_args(argv)
    print(f"rule (fixed before the first run): {RULE}", flush=True)
    print(f"drop rule (fixed before the first run): {DROP_RULE}", flush=True)
    scoring = scoring_of(args)
    sets = score_sets(args, score_set, scoring)
    # the rules need both four-arm sets: one set misordered rejects a candidate, every pair of both keeps it
    every = {name: all(s["orders_every_pair"][name] for s in sets) for name in CANDIDATES}
    print("every separated pair of the sets given: " + "; ".join(f"{n} {'yes' if ok else 'no (rejected)'}"
                                                                   for n, ok in every.items()), flush=True)
    out = {"rule": RULE, "drop_rule": DROP_RULE, "scoring": None if scoring is None else str(scoring),
           "sets": sets, "orders_every_pair": every}
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
