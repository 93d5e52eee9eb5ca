"""One progress-callback type and one cancellation error for the whole package."""

from __future__ import annotations

import importlib

import pytest

from models.base import progress


@pytest.mark.parametrize("module", ["models.affinity.scoring", "models.distill", "models.distill.run",
                                    "models.evaluation.evaluate", "models.export.resident", "models.run.pipeline"])
def test_every_stage_reports_through_the_same_progress_type(module):
    assert importlib.import_module(module).Progress is progress.Progress


def test_cancelled_is_one_error_wherever_it_is_imported_from():
    from models.affinity.scoring import Cancelled

    assert Cancelled is progress.Cancelled and issubclass(Cancelled, RuntimeError)
