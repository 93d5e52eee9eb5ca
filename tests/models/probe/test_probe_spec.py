"""The probe as a job field (issue 45 item 4): declared once in models/run/jobspec.py with its bounds and help,
taken by `dtp-layout optimise` and `client submit` as flags, refused naming the field where it cannot run, off by
default, and counted in the job's work tokens and budgets at submit. Torch-free (no model is loaded)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.cli.args.spec_flags import spec_body
from app.cli.commands.optimise import job_spec
from app.cli.errors import CliError
from app.cli.main import build_parser
from app.core.schemas.jobs import JobSpec
from app.core.services.budgets import job_problems, job_work
from models.probe.spec import MAX_CANDIDATES, PROBE_BATCH, ProbeSpec, probe_of
from models.run.jobspec import BY_PATH
from models.run.plan import plan_run
from tests.service_kit import make_settings

BASE = {"model": {"id": "m"}, "devices": 2, "calibration": {"source": "corpus:shakespeare", "sequences": 8,
                                                              "seq_len": 64}}
OPTIMISE = ["optimise", "m", "-L", "2", "--calib", "corpus:shakespeare", "--out", "o"]


def test_the_fields_are_declared_with_their_bounds_defaults_and_help():
    probe, steps = BY_PATH["probe"], BY_PATH["probe_steps"]
    assert probe.default == 0 and probe.rule.ge == 0 and probe.rule.le == MAX_CANDIDATES
    assert "held-out" in probe.rule.doc and "0: no probe" in probe.rule.doc
    assert steps.default == 20 and steps.rule.ge == 1 and str(PROBE_BATCH) in steps.rule.doc
    assert BY_PATH["probe_eval_sequences"].default == 16 and BY_PATH["probe_max_seconds"].default == 3600
    for path in ("probe", "probe_steps", "probe_eval_sequences", "probe_max_seconds"):
        assert {c for f in BY_PATH[path].rule.flags for c in f.commands} == {"optimise", "submit"}, path


def test_off_by_default_no_probe_stage_and_no_probe_work():
    spec = JobSpec.model_validate(BASE)
    assert spec.probe == 0 and probe_of(spec) is None
    assert "probing" not in plan_run(spec).stage_names
    assert job_work(spec).probe == 0


def test_a_probe_adds_its_stage_its_spec_and_its_tokens():
    spec = JobSpec.model_validate({**BASE, "probe": 3, "probe_steps": 10, "probe_eval_sequences": 4})
    plan = plan_run(spec)
    assert plan.stage_names.index("probing") == plan.stage_names.index("optimising") + 1
    assert plan.probe == ProbeSpec(candidates=3, steps=10, eval_sequences=4, max_seconds=3600)
    assert plan.facts.distills  # a probe distils: a streamed model is refused (models/run/rules.py)
    evaluations = len(plan.probe.recipe().eval_steps())
    work = job_work(spec)
    assert work.probe == 3 * 10 * PROBE_BATCH * 64 + (3 * evaluations + 1) * 4 * 64
    assert work.tokens > job_work(JobSpec.model_validate(BASE)).tokens + work.probe  # its candidates' optimiser work


@pytest.mark.parametrize(("given", "field", "said"), [
    ({"probe": 1}, "probe", "0 (no probe) or 2"),
    ({"probe": MAX_CANDIDATES + 1}, "probe", "less than or equal"),
    ({"probe_steps": 0}, "probe_steps", "greater than or equal"),
    ({"probe": 2, "calibration": {"source": "corpus:shakespeare", "sequences": 3, "seq_len": 64}}, "",
     "calibration.sequences must be ≥ 4"),
])
def test_a_probe_that_cannot_run_is_refused_naming_the_field(given, field, said):
    with pytest.raises(ValidationError) as refused:
        JobSpec.model_validate({**BASE, **given})
    errors = refused.value.errors()
    assert any(".".join(map(str, e["loc"])) == field and said in e["msg"] for e in errors), errors


def test_the_budget_refuses_a_probe_over_the_distillation_budget_naming_probe_steps(tmp_path):
    spec = JobSpec.model_validate({**BASE, "probe": 8, "probe_steps": 10_000})
    settings = make_settings(tmp_path, max_distill_tokens=1 << 20)
    problems = dict(job_problems(spec, settings))
    assert "DTP_LAYOUT_MAX_DISTILL_TOKENS" in problems["probe_steps"]
    assert f"{8 * 10_000 * PROBE_BATCH * 64:,}" in problems["probe_steps"]
    held_out = JobSpec.model_validate({**BASE, "probe": 2, "probe_eval_sequences": 4096})
    small = make_settings(tmp_path, max_calibration_tokens=4096 * 64 - 1)
    assert "DTP_LAYOUT_MAX_CALIBRATION_TOKENS" in dict(job_problems(held_out, small))["probe_eval_sequences"]


def test_the_optimise_and_submit_flags_set_the_fields():
    parser = build_parser()
    args = parser.parse_args([*OPTIMISE, "--probe", "4", "--probe-steps", "5", "--probe-max-seconds", "60"])
    spec = job_spec(args)
    assert (spec.probe, spec.probe_steps, spec.probe_eval_sequences, spec.probe_max_seconds) == (4, 5, 16, 60)
    assert job_spec(parser.parse_args(OPTIMISE)).probe == 0
    with pytest.raises(CliError, match=r"--probe: .*0 \(no probe\) or 2"):
        job_spec(parser.parse_args([*OPTIMISE, "--probe", "1"]))
    submit = parser.parse_args(["client", "submit", "--model", "m", "-L", "2", "--calib", "corpus:kjv", "--probe",
                                "2", "--probe-steps", "7"])
    body = spec_body(submit, "submit")
    assert body["probe"] == 2 and body["probe_steps"] == 7
