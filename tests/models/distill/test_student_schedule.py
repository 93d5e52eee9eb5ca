"""The student simulates the distillation's communication schedule (issue 20), and the runs record it.

Checked against the dense model: under `tp` the student is the dense model exactly (a_n = b_n = n+1), so
its KL to the teacher at step 0 is zero, while the layout's dtp:1 student starts well away from it.
"""

from __future__ import annotations

import json

import pytest
import torch

from models import distill as D
from models.distill.recipe import DistillError
from models.schedules.grammar import parse_schedule
from tests.models.distill.kit import layout_of, recipe, run


def test_under_tp_the_student_is_the_dense_model(setup):
    teacher, train = setup
    layout = layout_of(teacher)
    ids = train[:2]
    with torch.no_grad():
        dense = teacher(ids).logits
        tp = D.make_student(teacher, layout, recipe(), parse_schedule("tp"))(ids)
        dtp = D.make_student(teacher, layout, recipe())(ids)
    assert (tp - dense).abs().max().item() < 1e-4
    assert (dtp - dense).abs().max().item() > 1e-2
    assert D.make_student(teacher, layout, recipe(), parse_schedule("pt:2")).schedule.name == "pt:2"


def test_a_run_distils_the_schedule_and_records_it(setup, tmp_path):
    teacher, train = setup
    r = recipe(steps=2, eval_every=2)
    tp = run(teacher, train, tmp_path / "tp", r=r, schedule=parse_schedule("tp"))
    dtp = run(teacher, train, tmp_path / "dtp", r=r)
    assert tp.records[0].step == 0 and abs(tp.records[0].kl) < 1e-6  # the dense model: nothing to distil
    assert dtp.records[0].kl > 1e-3
    assert json.loads((tmp_path / "tp" / "metrics.json").read_text())["schedule"] == "tp"
    assert json.loads((tmp_path / "dtp" / "metrics.json").read_text())["schedule"] == "dtp:1"
    # Another schedule is another run: its directory is not resumed as this one.
    with pytest.raises(DistillError, match="different configuration"):
        run(teacher, train, tmp_path / "tp", r=r, schedule=parse_schedule("ladder"))


def test_the_spec_takes_a_parsed_schedule_and_refuses_what_it_cannot_run():
    from models.data.calibration import CalibrationSpec

    data = CalibrationSpec(source="s", sequences=4, seq_len=8)
    spec = D.DistillSpec(layouts=("contiguous",), train=data, eval=data, devices=2, delta=2,
                         schedule=parse_schedule("spd:2,0"))
    assert str(spec.schedule) == "spd:0,2" and str(spec.run_schedule) == "spd:0,2"
    same = D.DistillSpec(layouts=("contiguous",), train=data, eval=data, devices=2, delta=2,
                         schedule=parse_schedule("dtp:2"))
    assert same.run_schedule is None  # delta's own: the runs' default, their fingerprints as before schedules
    with pytest.raises(DistillError, match=r"schedule: a ScheduleSpec .* got str"):
        D.DistillSpec(layouts=("contiguous",), train=data, eval=data, devices=2, schedule="pt:2")
    with pytest.raises(DistillError, match=r"schedule: spd:auto:2 chooses its layers"):
        D.DistillSpec(layouts=("contiguous",), train=data, eval=data, devices=2, schedule=parse_schedule("spd:auto:2"))
