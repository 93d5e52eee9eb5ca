"""Distillation as a job stage, on the real stack (API on Postgres, Celery workers on Redis): a tiny
random model, two layouts × one seed × 4 steps. The curves come from GET /v1/jobs/{id}/metrics as they
are produced, once per (layout, seed, step, name) in the metrics table; a worker killed mid-stage
leaves the runs' checkpoints, and the redelivered job resumes them onto the uninterrupted curve."""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections import Counter

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from app.api.main import create_app
from app.core.db import Artifact, Metric, database
from tests.faults import Faults
from tests.service_kit import CALIB, TINY_DISTILL, WorkerProcess, job_history, spec, wait_for, worker_settings

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.worker]

DISTILL = TINY_DISTILL
LAYOUTS = DISTILL["layouts"]
BODY = spec(random_layouts=0, ablations=False, export={"checkpoint": False, "shards": True}, distill=DISTILL)
STAGES = ["loading", "calibration", "affinity", "optimising", "exporting", "distilling"]
# Per layout: kl, ppl and lr at steps 0, 2 and 4; the loss at steps 2 and 4 (none before the first step).
ROWS_PER_LAYOUT = 3 * 3 + 2


@pytest.fixture(scope="module")
def settings(tmp_path_factory, postgres_server, redis_broker):
    # A short lease: a killed worker's job is re-enqueued within seconds.
    return worker_settings(tmp_path_factory.mktemp("distill"), postgres_server, redis_broker, "distill",
                           lease_s=2.0)


# A sleep before every training step (tests/faults.py), so that the distilling stage is reliably caught
# mid-way.
SLOW = Faults(stage_delay_s=0.4)


@pytest.fixture(scope="module")
def first_worker(settings):
    w = WorkerProcess(settings, settings.var_dir / "workers.log", name="first", faults=SLOW).start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def client(settings, first_worker):
    with TestClient(create_app(settings)) as c:
        yield c


def metric_counts(settings, job_id):
    with database(settings.database_url).session() as session:
        return session.execute(select(Metric.layout, Metric.seed, Metric.step, Metric.name, func.count())
                               .where(Metric.job_id == job_id)
                               .group_by(Metric.layout, Metric.seed, Metric.step, Metric.name)).all()


def history(settings, job_id):
    return job_history(settings, job_id)


@pytest.fixture(scope="module")
def uninterrupted(client, first_worker):
    job = client.post("/v1/jobs", json=BODY).json()
    return wait_for(client, job["id"], timeout=90, worker=first_worker)


def test_distill_stage_writes_curves_metrics_and_artifacts(client, settings, uninterrupted):
    job = uninterrupted
    assert job["status"] == "succeeded", job
    assert job["stages_done"] == STAGES and job["timings"]["distilling"] > 0
    done = next(e for e in history(settings, job["id"]) if e["event"] == "stage-done" and e["stage"] == "distilling")
    assert done["steps_trained"] == done["total_steps"] == 8

    body = client.get(job["links"]["metrics"]).json()
    assert [(c["layout"], c["seed"]) for c in body["curves"]] == [(name, 0) for name in LAYOUTS]
    for curve in body["curves"]:
        assert curve["steps"] == [0, 2, 4]
        assert all(k > 0 for k in curve["kl"]) and all(p > 1 for p in curve["ppl"])
        assert curve["loss"][0] is None and all(x > 0 for x in curve["loss"][1:])
        assert curve["lr"][0] == pytest.approx(1e-3)  # warm-up of one step: step 0 runs at the peak lr
    headline = body["summary"]["headline"]
    assert headline["reference"] == "contiguous" and headline["candidate"] == "optimised"
    assert headline["reference_final_step"] == 4 and body["summary"]["dense_ppl"] > 1
    assert job["summary"]["distill"]["headline"] == headline

    counts = metric_counts(settings, job["id"])
    assert {row[-1] for row in counts} == {1} and len(counts) == len(LAYOUTS) * ROWS_PER_LAYOUT

    arts = {a["name"]: a for a in client.get(job["links"]["artifacts"]).json()["items"]}
    assert {n for n, a in arts.items() if a["kind"] == "distill"} == {"distill/metrics.csv", "distill/summary.json",
                                                                      "distill/curves.png"}
    files = {}
    for name in ("distill/metrics.csv", "distill/summary.json", "distill/curves.png"):
        r = client.get(arts[name]["link"])
        assert r.status_code == 200 and hashlib.sha256(r.content).hexdigest() == arts[name]["sha256"]
        files[name] = r.content
    assert files["distill/curves.png"].startswith(b"\x89PNG")
    rows = list(csv.DictReader(io.StringIO(files["distill/metrics.csv"].decode())))
    assert [(r["layout"], int(r["step"])) for r in rows] == [(n, s) for n in LAYOUTS for s in (0, 2, 4)]
    by_key = {(c["layout"], s): k for c in body["curves"] for s, k in zip(c["steps"], c["kl"], strict=True)}
    assert all(float(r["kl"]) == by_key[(r["layout"], int(r["step"]))] for r in rows)  # the API = the file
    summary = json.loads(files["distill/summary.json"])
    assert summary["format"] == "dtp-layout-distill/1" and set(summary["layouts"]) == set(LAYOUTS)
    assert summary["train"]["source"] == CALIB == summary["eval"]["source"]  # names, not the server's paths
    # Held out on one file: training after the 8 × 32 calibration tokens (16 blocks of 16), evaluation
    # after training's 8 blocks; the placement is reported in summary.json and report.json.
    assert (summary["train"]["skip_blocks"], summary["eval"]["skip_blocks"]) == (16, 24)
    assert summary["data"]["held_out"] and not summary["data"]["overlaps"]
    assert {m["part"] for m in summary["data"]["moved"]} == {"train", "eval"}
    report = client.get(arts["report.json"]["link"]).json()
    assert report["data"] == summary["data"] and report["calibration_identity"].startswith("sha256:")
    assert str(settings.data_dir) not in json.dumps(report) + json.dumps(summary)  # no server path leaks


def test_a_job_runs_its_schedule_through_distillation_and_export(client, settings, uninterrupted, first_worker):
    """schedule=tp: the student starts as the dense model (KL 0 at step 0, where the dtp:1 jobs above start
    above 0: an independent check that it simulates the job's schedule), and the manifest, report.json and
    summary.json record the schedule."""
    body = {**BODY, "schedule": "tp", "distill": {**DISTILL, "layouts": ["contiguous"], "steps": 2}}
    job = client.post("/v1/jobs", json=body).json()
    job = wait_for(client, job["id"], timeout=90, worker=first_worker)
    assert job["status"] == "succeeded", job
    assert job["spec"]["schedule"] == "tp"
    curve = client.get(job["links"]["metrics"]).json()["curves"][0]
    assert curve["steps"][0] == 0 and abs(curve["kl"][0]) < 1e-6
    arts = {a["name"]: a for a in client.get(job["links"]["artifacts"]).json()["items"]}
    manifest = client.get(arts["shards/manifest.json"]["link"]).json()
    report = client.get(arts["report.json"]["link"]).json()
    summary = client.get(arts["distill/summary.json"]["link"]).json()
    assert manifest["schedule"] == report["schedule"] == summary["schedule"] == "tp"
    assert any("schedule=tp" in note for note in report["notes"])  # optimised with the dtp:1 objective


def test_a_spd_auto_job_distils_and_exports_the_layers_its_affinity_stage_chose(client,
                                                                                 first_worker):
    """schedule=spd:auto:1: the affinity stage measures each layer's sensitivity; report.json names the least
    sensitive layer (ties: the lower) as spd:i, and the manifest and the distillation use that spd:i."""
    body = {**BODY, "schedule": "spd:auto:1", "distill": {**DISTILL, "layouts": ["optimised"], "steps": 2}}
    job = client.post("/v1/jobs", json=body).json()
    job = wait_for(client, job["id"], timeout=120, worker=first_worker)
    assert job["status"] == "succeeded", job["error"]
    assert job["spec"]["schedule"] == "spd:auto:1"
    arts = {a["name"]: a for a in client.get(job["links"]["artifacts"]).json()["items"]}
    report = client.get(arts["report.json"]["link"]).json()
    sensitivities = report["spd_sensitivities"]
    assert len(sensitivities) == 3 and all(s >= 0 for s in sensitivities)
    chosen = f"spd:{min(range(3), key=lambda i: (sensitivities[i], i))}"
    manifest = client.get(arts["shards/manifest.json"]["link"]).json()
    summary = client.get(arts["distill/summary.json"]["link"]).json()
    assert report["schedule"] == manifest["schedule"] == summary["schedule"] == chosen
    assert any(note.startswith(f"spd:auto:1 chose {chosen}") for note in report["notes"])
    # only the chosen layer's attention → FFN edge exists: every other layer's fraction is null
    layouts = client.get(job["links"]["layouts"])
    assert layouts.status_code == 200, layouts.text
    optimised = next(lay for lay in layouts.json()["items"] if lay["name"] == "optimised")
    assert [f is not None for f in optimised["up_fraction"]] == [f"spd:{i}" == chosen for i in range(3)]


def test_cancel_while_distilling(client, settings, uninterrupted, first_worker):
    body = {**BODY, "export": False, "distill": {**DISTILL, "steps": 40}}
    job_id = client.post("/v1/jobs", json=body).json()["id"]
    running = wait_for(client, job_id, timeout=60, worker=first_worker,
                       until=lambda j: (j["stage"] == "distilling" and j["progress"] > 0)
                       or j["status"] not in ("queued", "running"))
    assert running["status"] == "running", running
    assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
    cancelled = wait_for(client, job_id, timeout=30, worker=first_worker)
    assert cancelled["status"] == "cancelled" and cancelled["stage"] == "distilling"
    assert "distilling" not in cancelled["stages_done"]
    names = {a["name"] for a in client.get(f"/v1/jobs/{job_id}/artifacts").json()["items"]}
    assert not any(n.startswith("distill/") for n in names)
    assert client.get(f"/v1/jobs/{job_id}/metrics").json()["curves"][0]["steps"][0] == 0  # kept what it made


def test_redelivered_job_resumes_distilling_onto_the_same_curve(client, settings, uninterrupted, first_worker):
    """Killed (SIGKILL) while the second layout trains; another worker picks the job up after the lease
    expires and resumes from the runs' checkpoints: the same curves as the uninterrupted job, each
    metric written once."""
    job_id = client.post("/v1/jobs", json=BODY).json()["id"]
    mid = wait_for(client, job_id, timeout=60, worker=first_worker,
                   until=lambda j: (j["stage"] == "distilling" and j["progress"] >= 0.55)
                   or j["status"] not in ("queued", "running"))
    assert mid["status"] == "running" and "distilling" not in mid["stages_done"], mid
    assert mid["eta_s"] is not None and (mid["eta_s"] > 0 or mid["progress"] == 1)  # 1: summary and plot left
    partial = client.get(f"/v1/jobs/{job_id}/metrics", params={"name": "kl"}).json()["curves"]
    assert partial and partial[0]["layout"] == "optimised" and partial[0]["steps"] == [0, 2, 4]
    first_worker.kill9()
    # Where the dead worker left the second layout's run: finished, or its last checkpoint's step.
    run_dir = settings.storage / "jobs" / job_id / "work" / "1" / "distill" / "runs" / "contiguous" / "seed-0"
    if json.loads((run_dir / "metrics.json").read_text())["complete"]:
        left_at = 4
    else:
        left_at = int(json.loads((run_dir / "checkpoint" / "run_state.json").read_text())["step"])

    second = WorkerProcess(settings, settings.var_dir / "workers.log", name="second", faults=SLOW).start()
    try:
        done = wait_for(client, job_id, timeout=60, worker=second)
    finally:
        second.stop()
    assert done["status"] == "succeeded" and done["attempts"] == 2, done
    assert done["stages_done"] == STAGES
    events = history(settings, job_id)
    counts = Counter(f"{e['event']}:{e.get('stage', '')}" for e in events)
    assert counts["stage-start:distilling"] == 2 and counts["stage-done:distilling"] == 1
    assert counts["stage-done:exporting"] == 1  # not redone
    # The second attempt read the finished optimised run back and resumed contiguous from its checkpoint.
    resumed = next(e for e in events if e["event"] == "stage-done" and e["stage"] == "distilling")
    assert resumed["total_steps"] == 8 and resumed["steps_trained"] == 4 - left_at, (resumed, left_at)

    expected = client.get(uninterrupted["links"]["metrics"]).json()
    got = client.get(done["links"]["metrics"]).json()
    assert [(c["layout"], c["seed"], c["steps"]) for c in got["curves"]] == [
        (c["layout"], c["seed"], c["steps"]) for c in expected["curves"]]
    for want, have in zip(expected["curves"], got["curves"], strict=True):
        assert have["loss"][0] is None is want["loss"][0]
        for name, start in (("kl", 0), ("ppl", 0), ("loss", 1), ("lr", 0)):
            assert have[name][start:] == pytest.approx(want[name][start:], rel=1e-6, abs=1e-9), (want["layout"], name)

    counts = metric_counts(settings, job_id)
    assert {row[-1] for row in counts} == {1} and len(counts) == len(LAYOUTS) * ROWS_PER_LAYOUT
    with database(settings.database_url).session() as session:
        names = session.scalars(select(Artifact.name).where(Artifact.job_id == job_id)).all()
    assert len(names) == len(set(names)) and {"distill/metrics.csv", "distill/summary.json",
                                              "distill/curves.png"} <= set(names)
