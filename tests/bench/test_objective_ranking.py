"""Issue 29: does J_σ order layouts the way they train? A small real-text setup, trained for real.

SmolLM2-135M cut to its first 2 layers (the same weights), L = 3, schedule dtp:2; four arms — the dtp:2-
optimised layout, the dtp:1-optimised one, contiguous and one random layout — each distilled under dtp:2
with seeds 0, 1, 2 on KJV and evaluated on held-out Shakespeare. The rule is the experiment's
(bench/schedule_experiment.py): two arms are compared only where every seed of one ends below every seed
of the other; there the damage-weighted J_σ(dtp:2) must be higher for the one that trains better.

What it asserts is the issue's ranking among the schedule-optimised, contiguous and random layouts. The
fourth arm is recorded, not asserted: in this 2-layer, 10-step setup the dtp:1-optimised layout trains
*ahead* of contiguous at dtp:2 while J_σ(dtp:2) puts it behind; on the 30-layer model it is the reverse
(it trains far behind contiguous, 1.998–2.029 vs 1.426–1.550, while J_σ(dtp:2) ranks it above:
docs/schedules.md). J_σ misorders that pair in both setups: the open question of the objective, printed by
this test and the bench, not hidden. Three alternatives were measured on both setups and rejected
(docs/schedules.md, "Does a better damage measure rank the other-schedule arm?"): the joint damage of every
missing write at once orders this setup's six pairs 1 of 6; J_σ without each block's first position
orders this setup 6 of 6 but the 30-layer one 4 of 6, and its optimised layouts train worse at dtp:2 and pt:4;
the joint damage of the part of each device's missing input that its own input does not linearly predict
orders this setup 5 of 6 and the 30-layer one 3 of 6.
"""

from __future__ import annotations

import pytest

from bench import schedule_experiment as exp

# Twelve real distillations: 1:57 wall pinned to one core (the other busy), 5 min at load 4 (2m44s of CPU), 35 min
# at load 10; `make test` takes 12:56 of pytest against its 15-minute target with the CPU busy 96 % of it, so
# these 2m44s of CPU (~1.5 min on 2 cores) would leave it half a minute of margin: it runs under `make test-long`
# with the other bench-scale proofs.
pytestmark = [pytest.mark.real, pytest.mark.long]

ISSUE_ARMS = ("optimised", "contiguous", "random-1000")


def test_damage_weighted_j_orders_optimised_contiguous_and_random_as_they_train(tmp_path, capsys):
    row = exp.main(["--layers", "2", "--schedules", "dtp:2", "--other", "dtp:1", "--devices", "3",
                    "--calib-sequences", "4", "--calib-seq-len", "128", "--eval", "corpus:shakespeare",
                    "--eval-blocks", "8", "--eval2-blocks", "2", "--seq-len", "64", "--batch-size", "2",
                    "--steps", "10", "--eval-every", "5", "--restarts", "1", "--seeds", "0,1,2",
                    *exp.RECORDED_SETS, "--work", str(tmp_path)])["dtp:2"]
    finals = row["final_kl"]
    assert all(len(finals[arm]) == 3 for arm in ISSUE_ARMS)
    j = row["predictors"]["J_damage"]
    separated = [(a, b) for a in ISSUE_ARMS for b in ISSUE_ARMS if a != b and exp.separated(finals[a], finals[b])]
    assert ("optimised", "contiguous") in separated and ("optimised", "random-1000") in separated, finals
    for better, worse in separated:
        assert j[better] > j[worse], (better, worse, j, finals)
    other = [r for r in row["ranking"]["J_damage"] if "optimised-other" in (r["better"], r["worse"])]
    with capsys.disabled():
        print(f"\nJ_damage(dtp:2) on the dtp:1-optimised arm's separated pairs: {other}")
