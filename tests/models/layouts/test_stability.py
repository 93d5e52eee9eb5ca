"""Calibration stability (models.variants.stability): each half's layout scored on both halves."""

from __future__ import annotations

import pytest

from models.variants.stability import half_layouts, stability_report
from tests.models.layouts.kit import L, brute_agreement, fake_result, units
from tests.models.optimise.kit import literal_J


@pytest.fixture(scope="module")
def result():
    return fake_result()


def test_stability_report_cross_scores_halves(result):
    halves = {"first": result, "second": fake_result(seed=1)}
    lays = half_layouts(halves, devices=L, delta=1, score_name="fo", restarts=0)
    rep = stability_report(halves, lays, score_name="fo", restarts=0, blocks={"first": 3, "second": 4})
    for built in ("first", "second"):
        for on in ("first", "second"):
            literal = literal_J(units(halves[on], "fo"), lays[built].kv_group_device, lays[built].neuron_device)
            assert rep["J"][f"{built}_on_{on}"] == pytest.approx(literal, abs=1e-12)
    assert rep["transfer"]["second"] == pytest.approx(rep["J"]["first_on_second"] / rep["J"]["second_on_second"])
    assert rep["halves"]["second"]["blocks"] == 4 and rep["restarts"] == 0
    assert rep["agreement"]["neurons"] == pytest.approx(
        brute_agreement(lays["first"].neuron_device, lays["second"].neuron_device, L))
    same = stability_report({"first": result, "second": result}, half_layouts(
        {"first": result, "second": result}, devices=L, delta=1, score_name="fo", restarts=0),
        score_name="fo", restarts=0, blocks={"first": 1, "second": 1})
    assert same["transfer"] == {"first": 1.0, "second": 1.0} and same["agreement"]["neurons"] == 1.0
