"""A cancel is honoured within about a second in every stage, measured from the job's own history
(`cancel-requested`, written by the API, to `cancelled`, written by the worker).

Stages whose work does not poll for a cancel (loading weights, reading the calibration set, the
optimiser, writing the export, reading a distillation's data) run in a thread that stops at its next
safe point (models.base.progress.check_stop); here they hang between safe points (tests/faults.py)
and run in-process on Postgres, and the job ends only once that thread has stopped; the stages that
ask between units of work (the affinity pass, training steps and micro-batches, every evaluation
batch) run for real on a Celery worker over Postgres and Redis, the evaluation ones on a distillation
whose evaluation is long: the dense model's and step 0's at the start of the stage, the last one at
its end. The monitor reads the flag once a second (its tick), so every latency is at most a tick plus
one unit of work.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from app.api.main import create_app
from app.core.caller import OPEN
from app.core.db import Job, Metric, database
from app.core.events import job_events
from app.core.migrate import upgrade
from app.core.schemas.jobs import JobSpec
from app.core.services.jobs import cancel_job, submit_job
from tests.faults import Faults
from tests.service_kit import CALIB, WorkerProcess, make_settings, provision, spec, wait_for, worker_settings
from worker.entry import run_job

# serial: cancel latency against LATENCY_S
pytestmark = [pytest.mark.postgres, pytest.mark.serial]

# A tick (1 s) plus one unit of work: here the stage delay (0.1 s) and one forward of up to 16 384 tokens
# through the teacher and the student, up to a second on 2 shared CPU cores (milliseconds on a GPU).
LATENCY_S = 2.5
TRAIN, EVAL, CALIB_BIG = "cost/train.npy", "cost/eval.npy", "cost/calib.npy"
# Every evaluation: 4096 blocks of 64 tokens, 16 forwards of MAX_FORWARD_TOKENS (256 blocks) each.
LONG_EVAL = {"source": EVAL, "sequences": 4096, "seq_len": 64}


def latency_s(settings, job: Job) -> float:
    """Seconds from the cancel request to the job's `cancelled` event, both from the job's events."""
    with database(settings.database_url).session() as session:
        at = {e.kind: e.at for e in job_events(session, job.id)}
    return (at["cancelled"] - at["cancel-requested"]).total_seconds()


def provision_data(settings) -> None:
    for name, size, seed in ((TRAIN, 1 << 16, 1), (EVAL, 1 << 18, 2), (CALIB_BIG, 1 << 15, 3)):
        path = settings.data_dir / name
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(path, np.random.default_rng(seed).integers(0, 97, size=size))


def distill_spec(**distill) -> dict:
    return spec(random_layouts=0, ablations=False, restarts=0, export=False, calibration={"source": CALIB},
                distill={"layouts": ["optimised"], "train": {"source": TRAIN, "sequences": 64, "seq_len": 256},
                         **distill})


# ---- stages that do not poll: stopped at their next safe point (in-process, Postgres) ----------------------

@pytest.mark.parametrize("stage", ["loading", "calibration", "optimising", "exporting", "distilling"])
def test_cancel_in_a_stage_that_cannot_ask(tmp_path, postgres_server, stage, inject_faults):
    """The stage hangs where nothing polls the flag, reaching a safe point every 50 ms; its thread stops
    there and the job ends within a tick. `distilling` hangs in reading its training and evaluation data."""
    url = postgres_server.create_database(f"dtp_cancel_{stage}")
    upgrade(url)
    settings = make_settings(tmp_path, database_url=url, device="cpu")
    inject_faults(hang_stage=stage)
    provision(settings)
    provision_data(settings)
    body = distill_spec(steps=1, eval={"source": EVAL, "sequences": 4, "seq_len": 16},
                        recipe={"batch_size": 1, "micro_batch_size": 1})
    body["export"] = {"checkpoint": True, "shards": True}
    db = database(url)
    with db.session() as session:
        job_id = submit_job(session=session, settings=settings, spec=JobSpec.model_validate(body), caller=OPEN,
                            enqueue=lambda _jid: None).id
    result: list[str] = []
    runner = threading.Thread(target=lambda: result.append(run_job(job_id, settings=settings, db=db, worker="w:1")),
                              daemon=True)  # should a stage hang for good, the test fails instead
    runner.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with db.session() as session:
            if session.get(Job, job_id).stage == stage:
                break
        time.sleep(0.05)
    time.sleep(0.5)  # into the hang
    with db.session() as session:
        cancel_job(session=session, job_id=job_id, caller=OPEN)
    runner.join(timeout=10)
    with db.session() as session:
        job = session.get(Job, job_id)
    assert result == ["cancelled"] and job.status == "cancelled" and job.stage == stage, (result, job.error)
    print(f"cancel in {stage} (hung): {latency_s(settings, job):.2f} s")
    assert latency_s(settings, job) < LATENCY_S


# ---- stages that ask between units of work: a real worker ---------------------------------------------

@pytest.fixture(scope="module")
def settings(tmp_path_factory, postgres_server, redis_broker):
    s = worker_settings(tmp_path_factory.mktemp("cancel"), postgres_server, redis_broker, "cancel")
    provision_data(s)
    return s


@pytest.fixture(scope="module")
def worker(settings):
    # The stage delay (tests/faults.py) sleeps before each unit of work: every stage lasts seconds.
    w = WorkerProcess(settings, settings.var_dir / "worker.log", faults=Faults(stage_delay_s=0.1)).start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def client(settings, worker):
    with TestClient(create_app(settings)) as c:
        yield c


def cancel_when(client, settings, worker, body, until, stage, what):
    """Submit `body`, cancel once `until(job view)` holds; the cancelled job row and the steps evaluated."""
    job_id = client.post("/v1/jobs", json=body).json()["id"]
    running = wait_for(client, job_id, timeout=120, worker=worker,
                       until=lambda j: until(j) or j["status"] not in ("queued", "running"))
    assert running["status"] == "running" and running["stage"] == stage, running
    assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
    done = wait_for(client, job_id, timeout=30, worker=worker)
    assert done["status"] == "cancelled" and done["stage"] == stage, done
    with database(settings.database_url).session() as session:
        job = session.get(Job, job_id)
        steps = sorted(set(session.scalars(select(Metric.step).where(Metric.job_id == job_id))))
    print(f"cancel in {what}: {latency_s(settings, job):.2f} s")
    return job, steps


@pytest.mark.redis
@pytest.mark.worker
def test_cancel_in_the_affinity_pass(client, settings, worker):
    body = spec(random_layouts=0, ablations=False, export=False, batch_size=1,
                calibration={"source": CALIB_BIG, "sequences": 64, "seq_len": 256})
    job, _ = cancel_when(client, settings, worker, body, lambda j: j["stage"] == "affinity" and j["progress"] > 0,
                         "affinity", "affinity")
    assert latency_s(settings, job) < LATENCY_S


@pytest.mark.redis
@pytest.mark.worker
def test_cancel_while_training(client, settings, worker):
    body = distill_spec(steps=200, eval={"source": EVAL, "sequences": 4, "seq_len": 256},
                        recipe={"batch_size": 4, "micro_batch_size": 1, "eval_every": 100})
    job, steps = cancel_when(client, settings, worker, body,
                             lambda j: j["stage"] == "distilling" and j["progress"] > 0, "distilling",
                             "distilling (training)")
    assert steps == [0]  # step 0 was evaluated, then training was under way
    assert latency_s(settings, job) < LATENCY_S


@pytest.mark.redis
@pytest.mark.worker
def test_cancel_in_the_evaluation_at_the_start_of_distilling(client, settings, worker):
    """The dense model's evaluation and step 0's (16 forwards of 16 384 tokens each) start the stage."""
    body = distill_spec(steps=1, eval=LONG_EVAL, recipe={"batch_size": 1, "micro_batch_size": 1,
                                                         "eval_batch_size": 4096})
    entered: dict[str, float] = {}

    def a_second_in(j):
        if j["stage"] == "distilling":
            entered.setdefault("t", time.monotonic())
        return "t" in entered and time.monotonic() - entered["t"] > 1.0

    job, steps = cancel_when(client, settings, worker, body, a_second_in, "distilling",
                             "distilling (evaluation at the start)")
    assert steps == []  # no evaluation finished
    assert latency_s(settings, job) < LATENCY_S


@pytest.mark.redis
@pytest.mark.worker
def test_cancel_in_the_evaluation_at_the_end_of_distilling(client, settings, worker):
    """After its one step the run evaluates again (16 forwards): the cancel lands in that evaluation."""
    body = distill_spec(steps=1, eval=LONG_EVAL, recipe={"batch_size": 1, "micro_batch_size": 1,
                                                         "eval_batch_size": 4096})
    # Progress counts token passes (models/distill/run.py): the dense reference (1 pass over the E evaluation
    # tokens), step 0's evaluation (2), the one step (4 over its 1 × 256 training tokens), then the last
    # evaluation (2), in 16 micro-batches. Cancel once half a micro-batch of that last evaluation has passed.
    e = LONG_EVAL["sequences"] * LONG_EVAL["seq_len"]
    total = e + 2 * e + 4 * 256 + 2 * e
    last_eval_starts = (e + 2 * e + 4 * 256) / total
    trigger = last_eval_starts + 0.5 * (2 * e / 16) / total
    job, steps = cancel_when(client, settings, worker, body,
                             lambda j: j["stage"] == "distilling" and j["progress"] >= trigger, "distilling",
                             "distilling (evaluation at the end)")
    assert steps == [0]  # the last evaluation (step 1) never finished
    assert latency_s(settings, job) < LATENCY_S
