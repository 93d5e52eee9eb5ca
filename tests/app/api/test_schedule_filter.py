"""The schedule as a filter (issue 43): a CI gate that names a schedule gets the latest job of that schedule,
not whichever job of the model finished last; `GET /v1/jobs` filters the same way; a bad schedule is a 422
naming the grammar. On the real Postgres (and Redis, the broker the app is built with); the jobs are written
to the database directly."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from models.schedules.grammar import ACCEPTED, MAX_SCHEDULE_CHARS
from tests.service_kit import delete_jobs, make_settings, provision, seed_finished_job

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

MODEL = "two-schedules-model"


@pytest.fixture(scope="module")
def settings(tmp_path_factory, postgres_server, redis_broker):
    from app.core.migrate import upgrade

    url = postgres_server.create_database("dtp_schedule")
    upgrade(url)
    broker, prefix = redis_broker
    s = make_settings(tmp_path_factory.mktemp("schedule"), database_url=url, broker_url=broker,
                      broker_key_prefix=f"{prefix}schedule:")  # its own: the API marks it with its database
    provision(s)
    return s


@pytest.fixture(scope="module")
def client(settings):
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture
def two_schedules(settings):
    """A dtp:1 job of MODEL, then a pt:2 job of it (finished later), then another dtp:1 job (latest)."""
    made = [seed_finished_job(settings, model_id=MODEL, schedule=s)[0] for s in ("dtp:1", "pt:2", "dtp:1")]
    yield made
    delete_jobs(settings, made)


def scores(client, **params):
    return client.get("/v1/scores", params={"model": MODEL, **params})


def test_a_gate_naming_a_schedule_gets_the_latest_job_of_that_schedule(client, two_schedules):
    _old_dtp, pt, new_dtp = two_schedules
    for asked, job_id in (("dtp:1", new_dtp), ("pt:2", pt), ("dtp:01", new_dtp), ("pt:002", pt)):
        r = scores(client, schedule=asked)
        assert r.status_code == 200, r.text
        assert r.json()["job_id"] == job_id, asked
    by_pt = scores(client, schedule="pt:2").json()
    assert by_pt["schedule"] == "pt:2" and by_pt["delta"] == 1  # δ: the layouts' (the spec's), as before
    assert scores(client, schedule="dtp:1").json()["schedule"] == "dtp:1"
    # δ alone is the shorthand for dtp:δ: a pt:2 job is no dtp:1 job, whenever it finished
    assert scores(client, delta=1).json()["job_id"] == new_dtp
    assert scores(client, delta=1, schedule="dtp:1").json()["job_id"] == new_dtp
    missing = scores(client, schedule="tp")
    assert missing.status_code == 404 and "schedule=tp" in missing.json()["detail"]


def test_the_latest_of_each_schedule_moves_on_its_own(client, settings, two_schedules):
    newer_pt, _ = seed_finished_job(settings, model_id=MODEL, schedule="pt:2")
    try:
        assert scores(client, schedule="pt:2").json()["job_id"] == newer_pt
        assert scores(client, schedule="dtp:1").json()["job_id"] == two_schedules[2]
    finally:
        delete_jobs(settings, [newer_pt])


def test_the_job_list_filters_by_schedule_and_shows_it(client, two_schedules):
    old_dtp, pt, new_dtp = two_schedules

    def listed(**params):
        r = client.get("/v1/jobs", params={"model": MODEL, **params})
        assert r.status_code == 200, r.text
        return {j["id"]: j["schedule"] for j in r.json()["items"]}

    assert listed(schedule="pt:2") == {pt: "pt:2"}
    assert listed(schedule="dtp:1") == listed(delta=1) == {old_dtp: "dtp:1", new_dtp: "dtp:1"}
    assert listed() == {old_dtp: "dtp:1", pt: "pt:2", new_dtp: "dtp:1"}
    assert client.get(f"/v1/jobs/{pt}").json()["schedule"] == "pt:2"


@pytest.mark.parametrize("path", ["/v1/scores", "/v1/jobs"])
@pytest.mark.parametrize("bad", ["bogus:1", "pt:0", "dtp:x", "spd:", "pt:2" + "0" * 5000])
def test_a_bad_schedule_is_a_422_naming_the_grammar(client, path, bad):
    r = client.get(path, params={"schedule": bad})
    assert r.status_code == 422, r.text
    errors = {e["field"]: e["msg"] for e in r.json()["detail"]}
    assert set(errors) == {"schedule"}
    if len(bad) < 100:  # the grammar's own message: what is wrong and every form it takes, from the registry
        assert f"accepted: {ACCEPTED}" in errors["schedule"]
    else:  # refused unread: longer than any schedule the grammar reads
        assert f"at most {MAX_SCHEDULE_CHARS} characters" in errors["schedule"]


@pytest.mark.parametrize("path", ["/v1/scores", "/v1/jobs"])
def test_delta_and_a_schedule_that_disagree_are_a_422(client, path):
    for params, says in (({"schedule": "dtp:2", "delta": 1}, "disagree"),
                         ({"schedule": "pt:2", "delta": 1}, "has no δ")):
        r = client.get(path, params=params)
        assert r.status_code == 422, r.text
        (error,) = r.json()["detail"]
        assert error["field"] == "delta" and says in error["msg"]
