"""models/run/plan.py and models/run/rules.py (issue 27): one plan from the job spec, the schedule parsed once
(spd:auto:K written back by the stage that chooses it), and the refusals of the plan and the loading stage."""

from __future__ import annotations

import pytest

from app.core.schemas.jobs import JobSpec
from models.base.layout_format import LayoutError
from models.run.plan import RunPlan, plan_run
from models.run.rules import (
    DeltaConflict,
    RunFacts,
    RunRefused,
    job_schedule,
    model_refusals,
    schedule_and_delta,
    spec_refusals,
)
from models.schedules.grammar import ScheduleError, ScheduleSpec, dtp_spec, parse_schedule, shorthand


def _spec(**overrides) -> JobSpec:
    body = {"model": {"id": "tiny"}, "devices": 2, "calibration": {"source": "calib/ids.npy", "sequences": 8,
                                                                    "seq_len": 32}, **overrides}
    return JobSpec.model_validate(body)


def test_the_plan_of_a_job_spec():
    plan = plan_run(_spec(schedule="pt:2", stability=True, export={"shards": False}),
                    data=lambda source, field: f"/data/{source}" if field == "calibration.source" else source)
    assert plan.stage_names == ("loading", "calibration", "affinity", "optimising", "stability", "exporting")
    assert plan.schedule == ScheduleSpec("pt", block=2) and str(plan.schedule) == "pt:2"
    assert plan.optimise.schedule == plan.schedule and plan.optimise.layout_independent_ok
    assert plan.calibration.source == "/data/calib/ids.npy" and plan.calibration_shown.source == "calib/ids.npy"
    assert (plan.checkpoint, plan.shards, plan.distill) == (True, False, None)
    assert plan.facts == RunFacts.of_spec(_spec(schedule="pt:2", stability=True, export={"shards": False}))
    assert plan_run(_spec(export=False)).stage_names == ("loading", "calibration", "affinity", "optimising")
    # delta alone is dtp:δ, one ScheduleSpec from the job spec on (the optimise spec and the distillation's too)
    shorthand_plan = plan_run(_spec(delta=2, distill={"layouts": ["optimised"], "steps": 1}))
    assert shorthand_plan.schedule == shorthand_plan.optimise.schedule == shorthand_plan.distill.schedule == dtp_spec(2)


def test_spd_auto_is_pending_until_the_affinity_stage_writes_its_layers_back():
    plan = plan_run(_spec(schedule="spd:auto:2", distill={"layouts": ["optimised"], "steps": 1}))
    assert plan.schedule_pending and plan.distill.run_schedule is None  # the students wait for the layers
    assert plan.stage_names[-1] == "distilling"
    plan.resolve_schedule("spd:0,2")
    assert not plan.schedule_pending and str(plan.schedule) == "spd:0,2" and str(plan.distill.schedule) == "spd:0,2"
    assert str(plan.optimise.schedule) == "spd:auto:2"  # the objective still says what chose them


def test_the_plan_refuses_what_the_run_would_whatever_the_model():
    with pytest.raises(RunRefused, match="stability needs at least 2 calibration blocks") as caught:
        plan_run(_spec(stability=True, calibration={"source": "x.npy", "sequences": 1}))
    assert [r.field for r in caught.value.refusals] == ["calibration.sequences"]
    refusals = spec_refusals(_spec(distill={"layouts": ["anti-optimised", "random:1000"], "steps": 1}))
    assert [(r.rule, r.field) for r in refusals] == [("distill-layouts", "distill.layouts.0"),
                                                     ("distill-layouts", "distill.layouts.1")]


def test_the_plan_carries_the_schedule_parsed_at_the_boundary():
    plan = RunPlan(model_id="m", dtype="float32", devices=2, delta=1, schedule=job_schedule("spd:3,1", 1))
    assert plan.schedule == parse_schedule("spd:1,3") and plan.stage_names == ("loading",)
    assert job_schedule(None, 2) == dtp_spec(2) and job_schedule(parse_schedule("tp"), 2) == parse_schedule("tp")


def test_the_schedule_and_delta_rule():
    assert schedule_and_delta("dtp:2", None) == (parse_schedule("dtp:2"), 2)
    assert schedule_and_delta("pt:2", 3) == (parse_schedule("pt:2"), 3)
    assert schedule_and_delta(None, 1) == (None, 1)
    with pytest.raises(DeltaConflict, match=r"schedule dtp:2 and delta=1 disagree"):
        schedule_and_delta("dtp:2", 1)
    with pytest.raises(ScheduleError, match="accepted"):
        schedule_and_delta("ring", 1)
    assert shorthand(parse_schedule("dtp:2"), 2) is None and shorthand(parse_schedule("dtp:2"), 1) == "dtp:2"


def test_model_refusals_name_the_field_and_the_error_the_run_raises():
    from models.base.shapes import ModelShape

    shape = ModelShape(model_type="llama", num_layers=3, num_kv_groups=4, num_query_heads=4, intermediate_size=96,
                       hidden_size=32, head_dim=8)
    assert model_refusals(RunFacts(devices=2, delta=1, schedule=dtp_spec(1)), shape) == []
    [devices] = model_refusals(RunFacts(devices=3, delta=1, schedule=dtp_spec(1)), shape)
    assert (devices.field, devices.error) == ("devices", LayoutError) and "valid L" in devices.message
    [spd] = model_refusals(RunFacts(devices=2, delta=1, schedule=parse_schedule("spd:auto:4")), shape)
    assert (spd.field, spd.error) == ("schedule", ScheduleError) and "K=4 layers to drop" in spd.message
    job = RunFacts(devices=2, delta=1, schedule=parse_schedule("tp"))
    assert model_refusals(job, shape) == []  # a job compares a layout-independent schedule
    [local] = model_refusals(RunFacts(devices=2, delta=1, schedule=parse_schedule("tp"), layout_independent_ok=False),
                             shape)
    assert local.rule == "layout-independent" and "no layout to optimise" in local.message


def test_the_loading_stage_refuses_a_streamed_schedule_with_further_edges(tmp_path):
    """What the API refuses at submit (tests/app/api/test_refusals.py), the loading stage of a run whose model
    was not checked before (a hub model) refuses by the same rule, before any weight is read."""
    from models.io.loading import ModelSource
    from models.run import stages
    from models.run.runner import Hooks, run_stages
    from models.streaming.memory_plan import MemoryLimitError, plan_memory
    from tests.tiny import tiny_model

    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "tiny")
    need = plan_memory(model.config, dtype="float32", command="optimise", limit=None, tokens=8 * 32,
                       batch_tokens=4 * 32, export=True)
    plan = plan_run(_spec(delta=2), max_memory=need.in_memory - 1)
    ctx = stages.RunContext.of(plan, run_dir=tmp_path / "run", source=lambda: ModelSource(str(tmp_path / "tiny")),
                               device="cpu")
    with pytest.raises(MemoryLimitError, match="schedule dtp:2 needs edges beyond the paper's chain"):
        run_stages(stages.STAGES, ctx, Hooks())
    assert ctx.model is None and ctx.streamed is None
