"""Observability: X-Request-ID on every answer, in the logs and in the job history; JSON logs with the
request, job, tenant and stage; /metrics counting 5xx and unhandled exceptions, and the job metrics
computed from the database (on SQLite and on Postgres: the SQL differs per dialect)."""

from __future__ import annotations

import json
import logging
import re
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from app.api.main import create_app
from app.core import logs
from app.core.db import Job, database, utcnow
from app.core.errors import ServiceUnavailable
from app.core.events import CLAIMED, REQUEUED, SUBMITTED, job_events, job_log_fields, record
from app.core.migrate import upgrade
from tests.app.conftest import api_keys_setting
from tests.service_kit import make_settings, provision, seed_finished_job, spec

KEYS = {"obs-a": "obs-a-key-0123456789abcdef", "obs-b": "obs-b-key-0123456789abcdef"}
HEX32 = re.compile(r"[0-9a-f]{32}")


def _settings(root, **overrides):
    s = make_settings(root, **{"metrics_cache_s": 0, "max_active_jobs": 1000, **overrides})
    root.mkdir(parents=True, exist_ok=True)
    upgrade(s.database_url)
    provision(s)
    return s


def _app(settings):
    app = create_app(settings)

    # Two routes that fail the ways a 5xx happens: a bug (unhandled) and an outage (handled 503).
    @app.get("/test/bug")
    def bug() -> None:
        raise RuntimeError("a bug")

    @app.get("/test/outage")
    def outage() -> None:
        raise ServiceUnavailable("down for the test")

    return app


@pytest.fixture
def keyed(tmp_path):
    settings = _settings(tmp_path / "var", api_keys=api_keys_setting(KEYS), log_format="json")
    with TestClient(_app(settings), raise_server_exceptions=False) as client:
        yield settings, client


def _json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# ---- X-Request-ID ------------------------------------------------------------------------------------

@pytest.mark.parametrize("sent", ["abc-123", "0f" * 16, "trace:1/2+3=4_x.y", "a" * 128])
def test_a_sane_request_id_comes_back(keyed, sent):
    _, client = keyed
    r = client.get("/healthz", headers={"X-Request-ID": sent})
    assert r.headers["x-request-id"] == sent


@pytest.mark.parametrize("sent", [None, "", "a" * 129, "has space", "semi;colon", "<script>", "quote\"d"])
def test_a_missing_or_insane_request_id_is_replaced(keyed, sent):
    _, client = keyed
    r = client.get("/healthz", headers={} if sent is None else {"X-Request-ID": sent})
    assert HEX32.fullmatch(r.headers["x-request-id"]), r.headers
    assert r.headers["x-request-id"] != sent


def test_every_answer_carries_a_distinct_request_id(keyed):
    _, client = keyed
    key = {"X-API-Key": KEYS["obs-a"]}
    answers = [client.get("/v1/jobs", headers=key), client.get("/v1/jobs/" + "0" * 32, headers=key),  # 200, 404
               client.get("/v1/jobs"),  # 401
               client.post("/v1/jobs", headers=key, json={"devices": 0}),  # 422
               client.post("/v1/jobs", headers={**key, "Content-Type": "application/json"},
                           content=b"x" * 70_000),  # 413 from the body limit
               client.get("/test/outage"), client.get("/test/bug"), client.get("/nowhere")]  # 503, 500, 404
    assert [a.status_code for a in answers] == [200, 404, 401, 422, 413, 503, 500, 404]
    ids = [a.headers.get("x-request-id") for a in answers]
    assert all(ids) and len(set(ids)) == len(ids)
    bug = answers[6]
    assert bug.json()["error"] == "internal_error" and ids[6] in bug.json()["detail"]


def test_submission_and_cancel_record_their_request_ids_in_their_events(keyed):
    settings, client = keyed
    key = {"X-API-Key": KEYS["obs-a"]}
    job = client.post("/v1/jobs", json=spec(), headers={**key, "X-Request-ID": "submit-req-1"})
    assert job.status_code == 202, job.text
    job_id = job.json()["id"]
    cancel = client.post(f"/v1/jobs/{job_id}/cancel", headers=key)  # no id sent: a generated one is recorded
    assert cancel.status_code == 202
    with database(settings.database_url).session() as session:
        by_kind = {e.kind: e for e in job_events(session, job_id)}
        assert job_log_fields(session, session.get(Job, job_id)) == {"tenant": "obs-a", "request_id": "submit-req-1"}
    assert by_kind["submitted"].request_id == "submit-req-1"
    assert by_kind["cancel-requested"].request_id == cancel.headers["x-request-id"]
    assert HEX32.fullmatch(cancel.headers["x-request-id"])


# ---- logs --------------------------------------------------------------------------------------------

def test_json_access_lines_name_request_job_and_tenant(keyed, capsys):
    _, client = keyed
    capsys.readouterr()
    key = {"X-API-Key": KEYS["obs-b"]}
    job_id = client.post("/v1/jobs", json=spec(), headers={**key, "X-Request-ID": "req-submit"}).json()["id"]
    client.get(f"/v1/jobs/{job_id}", headers={**key, "X-Request-ID": "req-poll"})
    client.get("/test/bug", headers={"X-Request-ID": "req-bug"})
    lines = _json_lines(capsys.readouterr().err)
    access = {line["request_id"]: line for line in lines if line["logger"] == "dtp_layout.access"}
    # the tenant is set by the key dependency (run in a worker thread) and still seen by the access line
    assert access["req-submit"] | {"ts": None} == access["req-submit"] | {
        "ts": None, "level": "INFO", "job_id": job_id, "tenant": "obs-b", "method": "POST", "path": "/v1/jobs",
        "route": "/v1/jobs", "status": 202}
    assert access["req-poll"]["job_id"] == job_id and access["req-poll"]["route"] == "/v1/jobs/{job_id}"
    assert access["req-poll"]["tenant"] == "obs-b" and access["req-poll"]["status"] == 200
    assert access["req-bug"]["status"] == 500
    bug = [line for line in lines if line["message"] == "unhandled error"]
    assert bug and bug[0]["request_id"] == "req-bug" and "RuntimeError: a bug" in bug[0]["exc"]


def test_text_logs_stay_readable_with_the_context_appended(tmp_path, capsys):
    settings = _settings(tmp_path / "var")
    assert settings.log_format == "text"
    with TestClient(create_app(settings)) as client:
        capsys.readouterr()
        client.get("/healthz", headers={"X-Request-ID": "plain-1"})
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "GET /healthz" in x)
    assert not line.startswith("{") and line.endswith("[request_id=plain-1]") and " 200 " in line


def test_the_worker_side_formatter_carries_job_tenant_and_stage(capsys):
    """What a worker does (worker/entry.py, worker/jobs.py): bind the job, then update tenant and stage;
    `adopt` gives Celery's handler the JSON format and the context."""
    logger = logging.getLogger("test.observability.worker")
    logger.propagate = False
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[celery] %(message)s"))
    logger.addHandler(handler)
    try:
        logs.adopt(logger, "json")
        with logs.bound(job_id="f" * 32):
            logs.update(tenant="team-a", stage="affinity")
            logger.warning("half way")
        logger.warning("after")
    finally:
        logger.removeHandler(handler)
    first, second = _json_lines(capsys.readouterr().err)
    assert first | {"ts": None} == {"ts": None, "level": "WARNING", "logger": "test.observability.worker",
                                    "message": "half way", "job_id": "f" * 32, "tenant": "team-a",
                                    "stage": "affinity"}
    assert "job_id" not in second and second["message"] == "after"


def test_log_format_setting_is_checked():
    assert make_settings(__import__("pathlib").Path("/tmp/x"), log_format="JSON").log_format == "json"
    with pytest.raises(ValueError, match="log_format"):
        make_settings(__import__("pathlib").Path("/tmp/x"), log_format="xml")


# ---- /metrics ----------------------------------------------------------------------------------------

def test_5xx_and_unhandled_exceptions_are_counted(keyed):
    _, client = keyed
    for _ in range(3):
        client.get("/test/bug")
    client.get("/test/outage")
    client.get("/healthz")
    samples = _samples(client.get("/metrics").text)
    assert samples[("dtp_layout_http_unhandled_exceptions_total", (("route", "/test/bug"),))] == 3
    assert samples[("dtp_layout_http_server_errors_total", (("route", "/test/bug"), ("status", "500")))] == 3
    assert samples[("dtp_layout_http_server_errors_total", (("route", "/test/outage"), ("status", "503")))] == 1
    assert ("dtp_layout_http_unhandled_exceptions_total", (("route", "/test/outage"),)) not in samples
    assert ("dtp_layout_http_server_errors_total", (("route", "/healthz"), ("status", "200"))) not in samples


def _seed_stats_jobs(settings) -> dict:
    """Jobs with known statuses, attempts, requeues, timings and ages; returns what /metrics must say,
    worked out here from the rows' values."""
    now = utcnow()
    rows = [
        # status, attempts, requeued events, timings, age (s)
        ("queued", 0, 0, {}, 30),
        ("queued", 2, 1, {"loading": 0.2}, 400),  # requeued once, back in the queue for 400 s
        ("running", 1, 0, {"loading": 0.7, "calibration": 3.0}, 50),
        ("succeeded", 3, 2, {"loading": 2.0, "calibration": 40.0, "affinity": 700.0, "optimising": 12.0,
                             "exporting": 4.0}, 5000),
        ("succeeded", 1, 0, {"loading": 1.0, "calibration": 0.5, "affinity": 60.0, "optimising": 0.4}, 4000),
        ("failed", 2, 1, {"loading": 30000.0}, 90000),
        ("cancelled", 0, 0, {}, 10),
    ]
    db = database(settings.database_url)
    with db.transaction() as session:
        for status, attempts, requeues, timings, age in rows:
            job = Job(spec=spec(), fingerprint="f" * 64, model_id="tiny", devices=2, schedule="dtp:1", score="fo",
                      status=status, owner="secret-tenant", progress=0.0, stages_done=list(timings),
                      timings=timings, cancel_requested=False, affinity_cached=False,
                      attempts=attempts, created_at=now - timedelta(seconds=age))
            session.add(job)
            session.flush()
            for kind in [SUBMITTED] + [CLAIMED, REQUEUED] * requeues:
                record(session, job.id, kind)
    stages: dict[str, list[float]] = {}
    for *_, timings, _age in rows:
        for stage, seconds in timings.items():
            stages.setdefault(stage, []).append(seconds)
    return {"status": {s: sum(r[0] == s for r in rows) for s in ("queued", "running", "succeeded", "failed",
                                                                  "cancelled")},
            "retries": sum(max(0, r[1] - 1) for r in rows), "requeues": sum(r[2] for r in rows),
            "oldest_queued": 400, "stages": stages}


def _check_job_metrics(text: str, expected: dict) -> None:
    samples = _samples(text)
    for status, n in expected["status"].items():
        assert samples[("dtp_layout_jobs", (("status", status),))] == n, status
    assert expected["retries"] == 4 and samples[("dtp_layout_job_retries_total", ())] == 4
    assert expected["requeues"] == 4 and samples[("dtp_layout_job_requeues_total", ())] == 4
    assert 399 <= samples[("dtp_layout_oldest_queued_job_age_seconds", ())] < 460
    for stage in ("loading", "calibration", "affinity", "optimising", "exporting", "distilling"):
        values = expected["stages"].get(stage, [])
        assert samples[("dtp_layout_job_stage_seconds_count", (("stage", stage),))] == len(values)
        assert samples[("dtp_layout_job_stage_seconds_sum", (("stage", stage),))] == pytest.approx(sum(values))
        for bound in (0.5, 1.0, 5.0, 60.0, 600.0, 21600.0):
            got = samples[("dtp_layout_job_stage_seconds_bucket", (("le", str(bound)), ("stage", stage)))]
            assert got == sum(v <= bound for v in values), (stage, bound)
        assert samples[("dtp_layout_job_stage_seconds_bucket", (("le", "+Inf"), ("stage", stage)))] == len(values)
    # Spot checks written out by hand: loading took 0.2, 0.7, 2, 1, 30000 s.
    assert samples[("dtp_layout_job_stage_seconds_bucket", (("le", "1.0"), ("stage", "loading")))] == 3
    assert samples[("dtp_layout_job_stage_seconds_bucket", (("le", "21600.0"), ("stage", "loading")))] == 4


def test_job_metrics_come_from_the_database_on_sqlite(tmp_path):
    settings = _settings(tmp_path / "var")
    expected = _seed_stats_jobs(settings)
    with TestClient(create_app(settings)) as client:
        text = client.get("/metrics").text
    _check_job_metrics(text, expected)
    assert "secret-tenant" not in text and "tiny" not in text  # aggregates only


@pytest.mark.postgres
def test_job_metrics_come_from_the_database_on_postgres(tmp_path, postgres_server):
    url = postgres_server.create_database("dtp_obs")
    upgrade(url)
    settings = make_settings(tmp_path / "var", database_url=url, metrics_cache_s=0)
    provision(settings)
    expected = _seed_stats_jobs(settings)
    # A second API process sees the same numbers: nothing is kept in the process.
    with TestClient(create_app(settings)) as one, TestClient(create_app(settings)) as two:
        texts = [one.get("/metrics").text, two.get("/metrics").text]
    for text in texts:
        _check_job_metrics(text, expected)
        assert "secret-tenant" not in text


def test_job_metrics_are_cached_for_metrics_cache_s(tmp_path):
    settings = _settings(tmp_path / "var", metrics_cache_s=300)
    seed_finished_job(settings, model_id="tiny")
    with TestClient(create_app(settings)) as client:
        first = _samples(client.get("/metrics").text)
        seed_finished_job(settings, model_id="tiny")
        second = _samples(client.get("/metrics").text)
    key = ("dtp_layout_jobs", (("status", "succeeded"),))
    assert first[key] == second[key] == 1  # a scrape flood is not a flood of table scans


def test_metrics_survive_an_unreadable_jobs_table(tmp_path, caplog):
    settings = _settings(tmp_path / "var")
    with TestClient(create_app(settings)) as client:
        with database(settings.database_url).transaction() as session:
            session.execute(__import__("sqlalchemy").text("ALTER TABLE jobs RENAME TO jobs_gone"))
        r = client.get("/metrics")
    assert r.status_code == 200 and "dtp_layout_http_requests_total" in r.text
    assert "dtp_layout_jobs{" not in r.text
    assert "cannot read the jobs table" in caplog.text


# ---- the whole path: serve's API and its real worker, JSON logs ----------------------------------------

@pytest.mark.worker
def test_serve_and_its_worker_log_json_lines_that_join_on_the_request_id(tmp_path):
    """`dtp-layout serve` with DTP_LAYOUT_LOG_FORMAT=json: the API's access line of the submission and the
    worker's lines of the job's run carry the same request id, the job id and, on the worker, the stage."""
    import httpx

    from tests.service_kit import ServeProcess, wait_for

    var = tmp_path / "var"
    provision(make_settings(var))
    serve = ServeProcess(var, DTP_LAYOUT_LOG_FORMAT="json")
    try:
        serve.start()
        with httpx.Client(base_url=serve.url, timeout=30) as client:
            submitted = client.post("/v1/jobs", json=spec(random_layouts=0, ablations=False, export=False),
                                    headers={"X-Request-ID": "ci-run-42"})
            assert submitted.status_code == 202, submitted.text
            job_id = submitted.json()["id"]
            done = wait_for(client, job_id, timeout=120)
        assert done["status"] == "succeeded", (done, serve.worker_log())
    finally:
        serve.stop()
    api = _json_lines("".join(serve.output))
    assert any(line.get("request_id") == "ci-run-42" and line.get("job_id") == job_id and line.get("status") == 202
               for line in api), api[-5:]
    worker = [line for line in _json_lines((var / "worker.log").read_text()) if line.get("job_id") == job_id]
    stages = {line.get("stage") for line in worker}
    assert {"loading", "affinity", "optimising"} <= stages, worker
    assert all(line["request_id"] == "ci-run-42" for line in worker if line.get("stage")), worker
