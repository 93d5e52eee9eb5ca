"""Comparing curves: the step a curve reaches a KL, the multipliers and the headline."""

from __future__ import annotations

import pytest

from models import distill as D


def test_reach_step_and_multipliers():
    steps = [0, 100, 200, 300]
    assert D.reach_step(steps, [5.0, 3.0, 2.0, 1.5], 2.5) == pytest.approx(150.0)
    assert D.reach_step(steps, [5.0, 3.0, 2.0, 1.5], 6.0) == 0.0
    assert D.reach_step(steps, [5.0, 3.0, 2.0, 1.5], 1.0) is None
    ref = (steps, [5.0, 4.0, 3.0, 2.0])
    cand = (steps, [5.0, 3.0, 2.0, 1.5])
    rows = D.multipliers(ref, cand)
    assert [r["step"] for r in rows] == [100, 200, 300]
    assert rows[0]["candidate_step"] == pytest.approx(50.0) and rows[0]["multiplier"] == pytest.approx(2.0)
    assert rows[1]["candidate_step"] == pytest.approx(100.0) and rows[1]["multiplier"] == pytest.approx(2.0)
    assert rows[2]["candidate_step"] == pytest.approx(200.0) and rows[2]["multiplier"] == pytest.approx(1.5)
    curves = {"contiguous": {"steps": steps, "kl": ref[1]}, "optimised": {"steps": steps, "kl": cand[1]}}
    head = D.headline(curves, reference="contiguous", candidate="optimised")
    assert head["candidate_step_to_reference_final_kl"] == pytest.approx(200.0)
    assert D.headline(curves, reference="contiguous", candidate="nope") is None


def per_seed(steps, *seeds):
    """A layout's curve as `mean_curves` writes it: the mean and each seed's KL."""
    mean = [sum(k) / len(seeds) for k in zip(*seeds, strict=True)]
    return {"steps": steps, "kl": mean, "seeds": {str(i): {"kl": list(s)} for i, s in enumerate(seeds)}}


STEPS = [0, 10, 20, 30, 40, 50]
CONTIGUOUS = per_seed(STEPS, (5, 3, 2.2, 1.8, 1.6, 1.5), (5, 3, 2.2, 1.8, 1.6, 1.5))  # final 1.5, reached at 50


def test_the_headline_gives_the_slowest_seeds_speedup_with_the_seeds_range_not_the_mean_curves():
    # seed 0 reaches 1.5 at step 20 (2.5×); seed 1 between 30 (1.6) and 40 (1.45): 30 + 0.1/0.15·10 = 36.67
    # (50/36.67 = 1.36×). Their mean curve (1.75 at 20, 1.4 at 30) reaches it at 27.14: 1.84×, which no seed has.
    cand = per_seed(STEPS, (4, 2, 1.5, 1.2, 1.1, 1.0), (4, 2.5, 2.0, 1.6, 1.45, 1.3))
    head = D.headline({"contiguous": CONTIGUOUS, "optimised": cand}, reference="contiguous", candidate="optimised")
    assert head["candidate_step_to_reference_final_kl"] == pytest.approx(20 + 0.25 / 0.35 * 10)
    assert head["speedup"]["per_seed"] == pytest.approx([2.5, 50 / (30 + 0.1 / 0.15 * 10)])
    assert head["speedup"]["slowest_seed"] == pytest.approx(1.3636, abs=1e-4) and head["speedup"]["seeds"] == 2
    assert head["said"] == ("optimised reaches contiguous's final KL 1.5 (step 50) by step 36.7: 1.36× fewer steps "
                            "(slowest of 2 seeds; the seeds 1.36×–2.50×).")
    summary = {"layouts": {"contiguous": {**CONTIGUOUS, "ppl": [1.0] * 6}, "optimised": {**cand, "ppl": [1.0] * 6}},
               "dense_ppl": 10.0, "headline": head}
    assert head["said"] in D.summary_table(summary)


def test_one_seed_says_so_and_a_reference_at_its_final_kl_at_step_0_gives_no_speedup():
    one = per_seed(STEPS, (4, 2, 1.5, 1.2, 1.1, 1.0))
    head = D.headline({"contiguous": per_seed(STEPS, (5, 3, 2.2, 1.8, 1.6, 1.5)), "optimised": one},
                      reference="contiguous", candidate="optimised")
    assert head["said"].endswith(": 2.50× fewer steps (one seed).")
    flat = per_seed(STEPS, (0.088, 0.124, 0.127, 0.112, 0.102, 0.096))  # training raised it: 0 steps against 0
    head = D.headline({"contiguous": flat, "optimised": per_seed(STEPS, (0.048, 0.096, 0.109, 0.098, 0.091, 0.086))},
                      reference="contiguous", candidate="optimised")
    assert not head["speedup"]["applicable"] and head["speedup"]["slowest_seed"] is None
    assert "no speedup" in head["said"] and "fewer steps" not in head["said"]
    never = per_seed(STEPS, (4, 2, 1.5, 1.2, 1.1, 1.0), (4, 3, 2.5, 2.0, 1.8, 1.6))
    head = D.headline({"contiguous": CONTIGUOUS, "optimised": never}, reference="contiguous", candidate="optimised")
    assert head["said"] == "optimised does not reach contiguous's final KL 1.5 (step 50) in 1 of 2 seed(s)."
