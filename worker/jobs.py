"""Running one job: the stages of `models/run/stages.py` through `models.run.runner`, resumable, idempotent
and cancellable; `JobRun` is the runner's hooks (lease, cancel checks, fencing, database recording).

A job is leased by the worker that claims it (`worker`, `lease_until`); a monitor thread renews the
lease about every second, writes progress and reads the cancel flag. A worker that dies stops
renewing; any worker's sweeper then re-enqueues the job, and the next run resumes after the last
stage recorded in `stages_done`:

- loading      model and tokenizer (re-done on resume: they live in memory); a GGUF model is loaded from
               its converted copy, STORAGE_ROOT/converted/<tenant>/<entry>/ (`models.io.converted`), made by
               the tenant's first job that loads it and reused by the later ones, never by another tenant's;
- calibration  token blocks → work/blocks.npy;
- affinity     → STORAGE_ROOT/affinity/<tenant>/<fingerprint>/affinity.safetensors, shared by the
               tenant's jobs with the same fingerprint (a later one reuses it: `affinity_cached`), never
               by another tenant's (`CachedAffinity`);
- optimising   layouts → work/layouts/*.json and the `layouts` rows, in one transaction with the stage;
- stability    when the spec asks: the halves' passes → work/stability.json, in report.json and the
               job's summary;
- exporting    the optimised layout's checkpoint and/or rank shards, published as artifacts (files
               renamed into place; rows and the stage recorded in one transaction);
- distilling   when the spec has `distill`: `models.distill.run_distill` over work/layouts into
               work/distill/, each evaluation written to the `metrics` table as it is produced (one
               row per job, layout, seed, step and name); a rerun resumes every run from its last
               checkpoint. Recorded as done, with the metrics.csv / summary.json / curves.png
               artifacts, once summary.json exists;
- then report.json and `succeeded`, in one transaction.

This module runs a claimed job (`run_claimed`: what a run comes to); the parts live by concern:

- worker/entry.py      the one entry point for a job (`run_job`: claim, lease, then `run_claimed`), which the
                       Celery task (worker/tasks.py) calls;
- worker/claiming.py   the claim and the sweeps that re-send messages;
- worker/monitor.py    the thread that renews the lease, writes progress and watches stalls and time limits;
- worker/run.py        `JobRun`: the runner's hooks (lease, cancel checks, fencing, stage rows), the spec in
                       the stages' terms;
- worker/publishing.py the run's `Publisher`: each finished stage's uploads and the rows recording them,
                       report.json and the summary, and the per-tenant affinity cache (`CachedAffinity`);
- worker/metrics.py    the distillation's evaluations in the `metrics` table;
- worker/failures.py   failed, cancelled or retried under the lease, the tenant's error text, and what each
                       exception comes to (`ended_by`).

Torch is imported inside the functions that need it (the API imports nothing from here).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from app.core import events, logs
from app.core.db import Database, Job
from app.core.events import job_log_fields
from app.core.lease import Lease, LeaseLost
from app.core.schemas.jobs import JobSpec
from app.core.services.sources import forget_configs
from app.core.settings import Settings
from worker.claiming import claim, requeue_queued, requeue_stale
from worker.failures import _end, _retry, ended_by, public_error, user_errors
from worker.metrics import read_metrics_csv, upsert_metrics
from worker.monitor import JobStalled, Monitor, TimeLimitExceeded
from worker.publishing import AFFINITY_COPY, DISTILL_FILES, CachedAffinity
from worker.run import JobCancelled, JobRun

log = logging.getLogger("dtp_layout.worker")

# Re-exported: the fence every write checks (app/core/lease.py), the claim and the sweeps
# (worker/claiming.py) and the monitor (worker/monitor.py), which live apart so that a job is claimed and
# its lease renewed (worker/entry.py) before this module is imported; and the run's parts,
# which callers and tests have imported from here (tests/faults.py patches `JobRun`, the class itself).
__all__ = ["AFFINITY_COPY", "DISTILL_FILES", "CachedAffinity", "JobCancelled", "JobRun", "JobStalled", "Lease",
           "LeaseLost", "Monitor", "TimeLimitExceeded", "_end", "_retry", "claim", "public_error", "read_metrics_csv",
           "requeue_queued", "requeue_stale", "run_claimed", "upsert_metrics", "user_errors"]


def run_claimed(job: Job, *, settings: Settings, db: Database, worker: str, monitor: Monitor,
                enqueue: Callable[[str], None] | None = None, on_hard_limit: Callable[[], None] | None = None) -> str:
    """Run a job this worker has just claimed (`claim`), through `worker.entry.run_job`. `monitor`: the one
    renewing the lease since the claim (started before this module was imported)."""
    from pydantic import ValidationError

    job_id = job.id
    lease = Lease(job_id, worker, job.attempts)
    with db.session() as session:
        logs.update(**job_log_fields(session, job))
        last_reason = events.last_requeue_reason(session, job_id) if lease.attempt > settings.max_attempts else None
    if job.cancel_requested or lease.attempt > settings.max_attempts:
        monitor.stop()
        if job.cancel_requested:
            _end(db, lease, status="cancelled", error="cancelled by request", stage=job.stage)
            return "cancelled"
        _end(db, lease, status="failed", stage=job.stage,
             error=f"gave up after {settings.max_attempts} attempts: {last_reason or 'the worker was lost each time'}")
        return "failed"
    runner: JobRun | None = None
    try:
        # The stored spec is validated again before anything runs (the schema may have changed since
        # it was accepted); one that no longer validates fails the job, with the reason.
        try:
            spec = JobSpec.model_validate(job.spec)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'spec'}: {e['msg']}" for e in exc.errors()[:5])
            raise ValueError(f"the stored job spec no longer validates: {problems}") from exc
        from app.core.services.budgets import work_tokens

        limits = settings.time_limits(work_tokens(spec))

        def hard_limit() -> None:
            # The run never reached a check (stuck in native code): record why, then the caller's
            # action (the Celery task kills its own process, as Celery's hard limit kills a pool process).
            if on_hard_limit is None or monitor.hard_hit.is_set():
                return
            monitor.hard_hit.set()
            _end(db, lease, status="failed", stage=monitor.stage,
                 error=f"exceeded its hard time limit of {limits[1]:g} s in stage {monitor.stage}; the worker "
                       "process was killed")
            log.error("job %s: hard time limit exceeded in %s", job_id, monitor.stage)
            on_hard_limit()

        monitor.watch_limits(limits, on_hard_limit=hard_limit)
        runner = JobRun(db=db, settings=settings, job=job, spec=spec, worker=worker, monitor=monitor)
        # After the monitor renews the lease: forgetting imports models.data.heldout (and so torch), which
        # can take longer than a short lease on a loaded machine, and a sweeper would requeue the job.
        _forget_earlier_reads()
        from models.data.calibration import set_tokenizer_limits

        set_tokenizer_limits(settings.tokenizer_limits())  # the tokenizer's child process (models.io.sandbox)
        runner.run()
        return "succeeded"
    except Exception as exc:
        stage = runner.stage if runner is not None else job.stage
        return ended_by(exc, db=db, lease=lease, settings=settings, job_id=job_id, owner=job.owner, stage=stage,
                        enqueue=enqueue)
    finally:
        monitor.stop()
        del runner
        _release_memory()


def _forget_earlier_reads() -> None:
    """Empty the process's caches of what earlier jobs read (GGUF metadata, content hashes of data
    files): a job's speed must not tell its tenant what another tenant's job named."""
    from models.data.heldout import forget_hashes

    forget_configs()
    forget_hashes()


def _release_memory() -> None:
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass
