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
