"""A cancelled job's work ends before the job does (issue 41): a real Celery worker over Postgres and Redis
runs a job whose calibration set is tokenised, in the sandbox's child process, by a backtracking regex
(`b*b*\\d` over lines of 2,000 `b`s: minutes of CPU). Cancelled in calibration, the child process is gone
within seconds, and the job is `cancelled` (its place in the tenant's budget and the worker's slot
free) only after the child is gone: abandoned work never overlaps the next job. Before, the job was
cancelled within a second while its child went on for up to 300 CPU-s, ignoring SIGTERM. A worker told
to shut down (SIGTERM, as `dtp-layout serve` and service managers stop it) stops the job the same way,
hands it back to the queue and exits; before, it went on with the job until its supervisor's SIGKILL."""

from __future__ import annotations

import signal
import time

import psutil
import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.db import Job, database
from tests.service_kit import WorkerProcess, job_history, spec, wait_for, worker_settings
from tests.tiny import backtracking_tokenizer

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.worker, pytest.mark.serial]

SLOW_MODEL, SLOW_TEXT = "slow-tokenizer", "calib/bs.txt"
# The monitor's tick (1 s) to see the flag, the sandbox's poll (0.1 s) and grace (1 s): slack for 2 busy cores.
GONE_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def settings(tmp_path_factory, postgres_server, redis_broker):
    from tests.tiny import tiny_model

    s = worker_settings(tmp_path_factory.mktemp("cancel-ends"), postgres_server, redis_broker, "cancel_ends")
    model_dir = s.models_dir / SLOW_MODEL
    backtracking_tokenizer().save_pretrained(model_dir)
    tiny_model("llama", vocab_size=257).save_pretrained(model_dir)
    text = s.data_dir / SLOW_TEXT
    text.parent.mkdir(parents=True, exist_ok=True)
    text.write_text(("b" * 2000 + "\n") * 64)
    return s


@pytest.fixture
def worker(settings):
    w = WorkerProcess(settings, settings.var_dir / "worker.log").start()
    yield w
    leftovers = psutil.Process(w.proc.pid).children(recursive=True) if w.proc and w.proc.poll() is None else []
    w.stop()
    for child in leftovers:  # on the old code: the tokenizer children outlived their jobs
        if child.is_running():
            child.kill()


def _status(settings, job_id: str) -> str:
    with database(settings.database_url).session() as session:
        return session.get(Job, job_id).status


def _in_calibration(client, worker) -> tuple[str, psutil.Process]:
    """A job of the slow tokenizer, in calibration: its id and its tokenizer's child process."""
    body = spec(model={"id": SLOW_MODEL}, calibration={"source": SLOW_TEXT, "sequences": 8, "seq_len": 32},
                random_layouts=0, ablations=False, export=False)
    reply = client.post("/v1/jobs", json=body)
    assert reply.status_code == 202, reply.text
    job_id = reply.json()["id"]
    running = wait_for(client, job_id, timeout=60, worker=worker,
                       until=lambda j: j["stage"] == "calibration" or j["status"] not in ("queued", "running"))
    assert running["status"] == "running" and running["stage"] == "calibration", running
    celery = psutil.Process(worker.proc.pid)
    deadline = time.monotonic() + 30
    while not (children := celery.children(recursive=True)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(children) == 1, children  # the tokenizer's sandboxed child
    time.sleep(1.0)
    assert children[0].is_running()  # backtracking (minutes of CPU per chunk)
    return job_id, children[0]


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_cancel_in_calibration_kills_the_tokenizer_child_before_the_job_ends(settings, worker):
    with TestClient(create_app(settings)) as client:
        job_id, child = _in_calibration(client, worker)
        celery = psutil.Process(worker.proc.pid)
        assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
        t0 = time.monotonic()
        gone_s = ended_s = None
        while time.monotonic() - t0 < 30 and (gone_s is None or ended_s is None):
            alive = _alive(child)
            status = _status(settings, job_id)
            if not alive and gone_s is None:
                gone_s = time.monotonic() - t0
            if status != "running" and ended_s is None:
                ended_s = time.monotonic() - t0
                assert not alive, f"the job was {status} {ended_s:.2f} s after the cancel, its child still running"
            time.sleep(0.02)
        print(f"cancel → tokenizer child gone: {gone_s} s; → job cancelled: {ended_s} s")
        assert gone_s is not None and gone_s < GONE_WITHIN_S, gone_s
        assert ended_s is not None and _status(settings, job_id) == "cancelled"
        assert celery.children(recursive=True) == []


def test_a_worker_told_to_shut_down_stops_the_job_and_hands_it_back(settings, worker):
    with TestClient(create_app(settings)) as client:
        job_id, child = _in_calibration(client, worker)
        assert worker.proc is not None
        t0 = time.monotonic()
        worker.proc.send_signal(signal.SIGTERM)  # Celery's warm shutdown
        while _alive(child) and time.monotonic() - t0 < 20:
            time.sleep(0.02)
        gone_s = time.monotonic() - t0
        code = worker.proc.wait(timeout=40)  # before: the job's calibration ran on (minutes)
        exited_s = time.monotonic() - t0
        print(f"SIGTERM → tokenizer child gone: {gone_s:.2f} s; → worker exited: {exited_s:.2f} s")
        assert gone_s < GONE_WITHIN_S and code == 0, (gone_s, code)
        job = client.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "queued" and job["attempts"] == 1, job
        reasons = [e.get("reason") for e in job_history(settings, job_id) if e["event"] == "requeued"]
        assert reasons == ["the worker shut down during calibration"], reasons
        assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 202  # queued: cancelled at once
