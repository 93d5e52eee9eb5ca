"""The `stability` stage as a job stage (run in process on SQLite, as a worker runs it): the report of
each half's layout on the other half is recorded in report.json and the job's summary, and a second
job that finds the affinity cached still reads the blocks the stage needs."""

from __future__ import annotations

import json

from sqlalchemy import select

from app.core.caller import OPEN
from app.core.db import Artifact, Job, LayoutRow
from app.core.events import job_events
from app.core.schemas.jobs import JobSpec
from app.core.services.jobs import job_view, submit_job
from app.core.storage.root import Storage
from models.run.files import kind_of
from tests.service_kit import spec
from worker.entry import run_job


def submit(settings, db, **overrides) -> str:
    body = JobSpec.model_validate(spec(random_layouts=0, ablations=False, export=False, **overrides))
    with db.session() as session:
        return submit_job(session=session, settings=settings, spec=body, caller=OPEN, enqueue=lambda _job_id: None).id


def finished(settings, db, job_id):
    with db.session() as session:
        job = session.get(Job, job_id)
        report_row = session.scalars(select(Artifact).where(Artifact.job_id == job_id,
                                                            Artifact.name == "report.json")).one()
        layouts = sorted(session.scalars(select(LayoutRow.name).where(LayoutRow.job_id == job_id)))
        events = job_events(session, job_id)
        history = [{"event": e.kind, "stage": e.stage, **(e.detail or {})} for e in events]
        return job_view(job, history=events), history, json.loads(
            Storage(settings.storage).path(report_row.storage_key).read_text()), layouts


def test_a_stability_job_records_the_stability_report(embedded):
    settings, db = embedded
    first = submit(settings, db, stability=True, restarts=0)
    assert run_job(first, settings=settings, db=db, worker="test:1") == "succeeded"
    view, history, report, layouts = finished(settings, db, first)
    assert view["stages_done"] == ["loading", "calibration", "affinity", "optimising", "stability"]
    assert view["timings"]["stability"] > 0
    stability = report["stability"]
    assert stability["halves"]["first"]["blocks"] == stability["halves"]["second"]["blocks"] == 4  # 8 blocks
    assert set(stability["J"]) == {"first_on_first", "second_on_first", "first_on_second", "second_on_second"}
    assert 0 < stability["agreement"]["neurons"] <= 1
    assert view["summary"]["stability"] == stability
    assert layouts == ["contiguous", "optimised"]  # the halves' layouts are the stage's own, not the job's
    done = next(e for e in history if e["event"] == "stage-done" and e["stage"] == "stability")
    assert done["transfer"] == stability["transfer"]
    with db.session() as session:  # what it published is declared (models/run/files.py ARTIFACTS), kind and all
        published = {(a.name, a.kind) for a in session.scalars(select(Artifact).where(Artifact.job_id == first))}
    assert published == {("affinity.safetensors", "affinity"), ("report.json", "report")}
    assert all(kind_of(name) == kind for name, kind in published)

    # Same inputs: the affinity comes from the cache, but the stability stage reads the blocks, so the
    # calibration stage loads them (it is not skipped as it is for a job without stability).
    second = submit(settings, db, stability=True, restarts=0)
    assert run_job(second, settings=settings, db=db, worker="test:1") == "succeeded"
    view2, history2, report2, _ = finished(settings, db, second)
    calibration = next(e for e in history2 if e["event"] == "stage-done" and e["stage"] == "calibration")
    assert calibration["tokens"] == 8 * 32 and "skipped" not in calibration
    assert "stability" in view2["stages_done"]
    assert report2["job"]["affinity_cached"] is True and report2["stability"] == stability

    third = submit(settings, db)  # without stability: no stage reads the blocks, none are read
    assert run_job(third, settings=settings, db=db, worker="test:1") == "succeeded"
    view3, history3, report3, _ = finished(settings, db, third)
    calibration = next(e for e in history3 if e["event"] == "stage-done" and e["stage"] == "calibration")
    assert calibration["skipped"] == "affinity cached"
    assert "stability" not in view3["stages_done"] and "stability" not in report3
    assert "stability" not in (view3["summary"] or {})
