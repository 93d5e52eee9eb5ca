"""The Celery task: a thin shim that takes a job id, re-reads the job and runs it (`worker.jobs`).

Every worker also runs a sweeper thread that re-enqueues jobs whose worker died (their lease
expired), so a job killed mid-stage resumes on another worker after its last finished stage.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from typing import Any

from celery.signals import worker_ready

from app import logs
from app.db import database
from app.settings import get_settings
from worker.celery_app import TASK_NAME, app, enqueue

log = logging.getLogger("dtp_layout.worker")
JOB_ID = re.compile(r"^[0-9a-f]{32}$")


@app.task(name=TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_job(self: Any, job_id: str) -> str:
    from worker import jobs

    if not isinstance(job_id, str) or not JOB_ID.match(job_id):
        log.error("ignoring a task with a malformed job id %r", job_id)
        return "invalid"
    settings = get_settings()
    worker = f"{self.request.hostname or 'worker'}:{os.getpid()}"
    with logs.bound(job_id=job_id):  # every line logged while the job runs names it (app/logs.py)
        return jobs.run_job(job_id, settings=settings, db=database(settings.database_url), worker=worker)


def _sweep_forever() -> None:
    from worker.jobs import requeue_stale

    settings = get_settings()
    db = database(settings.database_url)
    interval = max(0.5, min(30.0, settings.lease_s / 2))
    while True:
        try:
            for job_id in requeue_stale(db, lambda jid: enqueue(app, settings, jid)):
                log.warning("job %s: its worker stopped renewing the lease; re-enqueued", job_id)
        except Exception:
            log.warning("sweeper: could not check for stale jobs", exc_info=True)
        time.sleep(interval)


@worker_ready.connect
def _start_sweeper(**_: Any) -> None:
    threading.Thread(target=_sweep_forever, name="dtp-layout-sweeper", daemon=True).start()
