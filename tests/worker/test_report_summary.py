"""The job summary a succeeded job shows: report.json's headline figures, with the kept mass of sparse
neuron→neuron edges when the run had any (issue 29)."""

from __future__ import annotations

from worker.publishing import report_summary


def report(kept_mass: dict | None) -> dict:
    return {"tokens": 256, "random_expectation": 4.3, "upper_bound": 8.6, "upper_bound_exact": False,
            "notes": ["n"], "kept_mass": kept_mass, "layouts": {"optimised": {"J": 8.1}, "contiguous": {"J": 6.6}}}


def test_the_summary_carries_the_kept_mass_of_sparse_edges():
    kept = {"min": 0.93, "median": 0.95, "max": 0.97, "edges": {"ffn0→ffn1": 0.95}}
    summary = report_summary(report(kept))
    assert summary["kept_mass"] == {"min": 0.93, "median": 0.95, "max": 0.97}  # not the per-edge list
    assert summary["layouts"] == {"optimised": 8.1, "contiguous": 6.6} and summary["tokens"] == 256


def test_a_run_with_dense_edges_has_no_kept_mass():
    assert "kept_mass" not in report_summary(report(None))
