"""`dtp-layout client` and the schedule (issue 43): `scores --schedule` gates on the latest job of that
schedule, and `status`, `list` and `scores` print the job's schedule where they printed "δ=1" for any
schedule. Against the real `dtp-layout serve` (embedded default: SQLite, migrated to head); the jobs are
written to its database directly."""

from __future__ import annotations

import json

import pytest

from tests.app.client.test_client import run
from tests.service_kit import delete_jobs, make_settings, seed_finished_job

pytestmark = [pytest.mark.worker]

MODEL = "client-schedules-model"


@pytest.fixture
def two_schedules(env):
    """A dtp:1 job of MODEL and, finished after it, a pt:2 job, both the `ci` tenant's."""
    settings = make_settings(env.var)
    made = [seed_finished_job(settings, model_id=MODEL, owner="ci", schedule=s)[0] for s in ("dtp:1", "pt:2")]
    yield dict(zip(("dtp:1", "pt:2"), made, strict=True))
    delete_jobs(settings, made)


def test_scores_gates_on_the_latest_job_of_the_schedule_it_names(two_schedules):
    for asked, shown in (("dtp:1", "dtp:1"), ("pt:2", "pt:2"), ("pt:02", "pt:2")):
        code, out, err = run("scores", "--model", MODEL, "--schedule", asked, "--json")
        assert code == 0, err
        assert json.loads(out)["scores"]["job_id"] == two_schedules[shown], asked
        code, out, err = run("scores", "--model", MODEL, "--schedule", asked, "--min-ratio", "1.2")
        assert code == 0 and f"L=2 schedule {shown} score fo" in out and f"job {two_schedules[shown]}" in out
    # --delta 1 is dtp:1: the pt:2 job, finished last, is not what it gates on
    code, out, _ = run("scores", "--model", MODEL, "--delta", "1", "--json")
    assert code == 0 and json.loads(out)["scores"]["job_id"] == two_schedules["dtp:1"]
    code, out, _ = run("scores", "--job", two_schedules["pt:2"], "--json")
    assert code == 0 and json.loads(out)["scores"]["schedule"] == "pt:2"
    code, out, err = run("scores", "--model", MODEL, "--schedule", "pt:two")
    assert code == 2 and out == "" and "schedule" in err and "accepted: " in err and "pt:D" in err


def test_status_and_list_show_the_schedule(two_schedules):
    pt = two_schedules["pt:2"]
    code, out, _ = run("status", pt)
    assert code == 0 and "L=2 schedule pt:2 score fo" in out and "δ=" not in out
    code, out, _ = run("list", "--model", MODEL)
    assert code == 0 and "schedule" in out.splitlines()[0]
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert set(rows) == set(two_schedules.values())
    for schedule, job_id in two_schedules.items():
        assert f" {schedule} " in rows[job_id]
    code, out, _ = run("list", "--model", MODEL, "--schedule", "pt:2", "--json")
    assert code == 0 and [(j["id"], j["schedule"]) for j in json.loads(out)] == [(pt, "pt:2")]
