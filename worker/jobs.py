"""Running one job: the stages of `models/stages.py` through `models.runner`, resumable, idempotent
and cancellable; `JobRun` is the runner's hooks (lease, cancel checks, fencing, database recording).

A job is leased by the worker that claims it (`worker`, `lease_until`); a monitor thread renews the
lease about every second, writes progress and reads the cancel flag. A worker that dies stops
renewing; any worker's sweeper then re-enqueues the job, and the next run resumes after the last
stage recorded in `stages_done`:

- loading      model and tokenizer (re-done on resume: they live in memory); a GGUF model is loaded from
               its converted copy, STORAGE_ROOT/converted/<tenant>/<entry>/ (`models.converted`), made by
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

Torch is imported inside the functions that need it (the API imports nothing from here).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import re
import shutil
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import insert, or_, select, update
from sqlalchemy.orm import Session

from app.core import events, logs
from app.core.db import Artifact, Database, Job, LayoutRow, Metric, db_now, utcnow
from app.core.hub import prepare_model
from app.core.lease import Lease, LeaseLost
from app.core.schemas import METRIC_NAMES, JobSpec
from app.core.services import DISTILL_SUMMARY, job_log_fields
from app.core.settings import Settings
from app.core.sources import ModelLocation, SourceError, forget_configs, resolve_data
from app.core.storage import Storage, sha256_file, tenant_scope
from app.core.upload_store import UploadStore
from models.runner import Hooks, run_stages
from models.schedules import parse_schedule
from models.stages import REPORT_INPUTS, STAGES, AffinityStore
from models.stages import build_report as stages_report
from worker.converted_mirror import StoreMirror
from worker.device import out_of_memory_message, prepare_device
from worker.outages import database_unreachable, disk_full, no_space_message, remove_work

log = logging.getLogger("dtp_layout.worker")
DISTILL_FILES = ("metrics.csv", "summary.json", "curves.png")
_AUTO: Any = object()  # Monitor.report: estimate the ETA from the stage's elapsed time


__all__ = ["Lease", "LeaseLost"]  # re-exported: the fence every write below checks (app/core/lease.py)


class JobCancelled(RuntimeError):
    pass


# ---- claiming and recovery -------------------------------------------------------------------------
#
# The lease and its fence (`attempts`) are app/core/lease.py's `Lease`: every write a run makes (stage
# rows, layouts, artifacts, metrics, the affinity cache, the lease) checks, in the same transaction,
# that the job is still at the run's attempt.

def claim(db: Database, job_id: str, *, worker: str, lease_s: float) -> Job | None:
    """Atomically take a queued job, or a running one whose lease expired. None: nothing to do."""
    with db.transaction() as session:
        lease = Lease.claim(session, job_id, worker=worker, lease_s=lease_s)
        if lease is None:
            return None
        job = lease.fence(session)
        job.started_at = job.started_at or utcnow()
        events.record(session, job_id, events.CLAIMED, attempt=lease.attempt, worker=worker)
    return job


def _resend(db: Database, job_id: str, send: Callable[[str], None], *, where: Any, values: dict[str, Any],
            reason: str) -> bool:
    """One sweeper's re-enqueue of one job: the guarded update is the atomic step (of several sweeping
    workers exactly one wins), then the message. A lost message is found again by the next sweeps."""
    with db.transaction() as session:
        result = session.execute(
            update(Job).where(Job.id == job_id, *where)
            .values(enqueued_at=db_now(), requeues=Job.requeues + 1, updated_at=utcnow(), **values)
            .execution_options(synchronize_session=False))
        if result.rowcount != 1:  # type: ignore[attr-defined]
            return False
        requeues = session.scalar(select(Job.requeues).where(Job.id == job_id))
        events.record(session, job_id, events.REQUEUED, reason=reason, requeues=requeues)
    try:
        send(job_id)
    except Exception:
        log.exception("could not re-enqueue job %s; a later sweep sends it again", job_id)
        return False
    return True


def requeue_stale(db: Database, send: Callable[[str], None]) -> list[str]:
    """Re-enqueue running jobs whose worker stopped renewing the lease (dead, or stalled). Clearing the
    lease makes the job claimable by whoever gets the message; should the message be lost, the job
    (queued-like: running, no lease) is swept by `requeue_queued` later."""
    with db.session() as session:
        stale = session.scalars(select(Job.id).where(Job.status == "running", Job.lease_until < db_now())).all()
    return [job_id for job_id in stale
            if _resend(db, job_id, send, where=(Job.status == "running", Job.lease_until < db_now()),
                       values={"lease_until": None}, reason="lease expired")]


def requeue_queued(db: Database, send: Callable[[str], None], *, after_s: float) -> list[str]:
    """Re-enqueue jobs that nobody holds (queued, or running with no lease) and whose message was sent
    more than `after_s` ago: the message was lost (crash between insert and enqueue, broker purged or
    restarted without persistence, a claim that failed on a database error). A duplicate message is
    harmless: `claim` lets one run through."""
    unheld = (Job.status.in_(("queued", "running")), Job.lease_until.is_(None),
              or_(Job.enqueued_at.is_(None), Job.enqueued_at < db_now(-after_s)))
    with db.session() as session:
        ids = session.scalars(select(Job.id).where(*unheld).order_by(Job.created_at).limit(500)).all()
    return [job_id for job_id in ids
            if _resend(db, job_id, send, where=unheld, values={},
                       reason=f"not picked up within {after_s:g} s of being queued")]


# ---- the monitor thread ----------------------------------------------------------------------------

class JobStalled(RuntimeError):
    """No progress for DTP_LAYOUT_STALL_S: this run is abandoned and the job retried."""


class TimeLimitExceeded(RuntimeError):
    """The run went past its soft time limit (derived from the job's size)."""


class Monitor(threading.Thread):
    """Renews the lease, writes progress and ETA (at most once per tick) and reads the cancel flag.

    It also watches the run: no progress for `stall_s` stops the lease renewal (`stalled`; the run
    stops at its next check and the job is retried); past the soft time limit `over_time` is set;
    past the hard limit `on_hard_limit` is called (the Celery task kills its own process: a solo
    pool cannot interrupt a stage that never returns)."""

    def __init__(self, db: Database, lease: Lease, lease_s: float, *, stall_s: float = float("inf"),
                 limits: tuple[float, float] = (float("inf"), float("inf")),
                 on_hard_limit: Callable[[], None] | None = None) -> None:
        super().__init__(name=f"monitor-{lease.job_id[:8]}", daemon=True)
        self.db, self.lease, self.job_id, self.lease_s = db, lease, lease.job_id, lease_s
        self.stall_s, self.limits, self.on_hard_limit = stall_s, limits, on_hard_limit
        self.tick = max(0.05, min(1.0, lease_s / 3, stall_s / 4))
        self.cancel = threading.Event()
        self.lost = threading.Event()
        self.stalled = threading.Event()
        self.over_time = threading.Event()
        self.hard_hit = threading.Event()
        self.stage: str | None = None
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self._fraction: float | None = None
        self._eta: float | None = _AUTO
        self._t0 = self._stage_t0 = self._alive = time.monotonic()

    def start_stage(self, stage: str | None = None) -> None:
        with self._lock:
            self._fraction, self._eta, self._stage_t0 = None, _AUTO, time.monotonic()
            self._alive, self.stage = self._stage_t0, stage

    def beat(self) -> None:
        """The stage advanced (a micro-batch, a chunk) without a new fraction to show."""
        self._alive = time.monotonic()

    def report(self, fraction: float, eta_s: float | None = _AUTO) -> None:
        """The stage's fraction done; eta_s when the caller knows better than elapsed·(1 − f)/f (a
        resumed stage starts part-way), None for not known yet."""
        with self._lock:
            self._fraction, self._eta = min(1.0, max(0.0, float(fraction))), eta_s
            self._alive = time.monotonic()

    def silent_s(self) -> float:
        return time.monotonic() - self._alive

    def _progress(self) -> dict[str, Any]:
        with self._lock:
            fraction, eta, t0 = self._fraction, self._eta, self._stage_t0
            self._fraction = None
        if fraction is None:
            return {}
        if eta is _AUTO:
            elapsed = time.monotonic() - t0
            eta = elapsed * (1 - fraction) / fraction if fraction > 0 else None
        return {"progress": fraction, "eta_s": eta}

    def flush(self) -> None:
        if not self.stalled.is_set() and self.silent_s() > self.stall_s:
            log.warning("job %s: no progress in %s for %.0f s; the lease is no longer renewed",
                        self.job_id, self.stage, self.silent_s())
            self.stalled.set()
        elapsed = time.monotonic() - self._t0
        if elapsed > self.limits[0]:
            self.over_time.set()
        if elapsed > self.limits[1] and self.on_hard_limit is not None:
            self.on_hard_limit()
        with self.db.transaction() as session:
            if not self.stalled.is_set() and not self.lease.renew(session, self.lease_s, **self._progress()):
                self.lost.set()
            if session.scalar(select(Job.cancel_requested).where(Job.id == self.job_id)):
                self.cancel.set()

    def run(self) -> None:
        while not self._halt.wait(self.tick):
            try:
                self.flush()
            except Exception:  # a database hiccup: the lease has slack, try again next tick
                log.warning("job %s: monitor could not update the job row", self.job_id, exc_info=True)

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout=10)


# ---- running the stages -----------------------------------------------------------------------------

AFFINITY_COPY = "affinity.cached.safetensors"  # the work directory's copy of the cache entry the stages read


class CachedAffinity(AffinityStore):
    """The affinity stage's result in the per-tenant cache (the store's affinity/<tenant>/<fingerprint>/),
    shared by the tenant's jobs with the same fingerprint, never by another tenant's. The stages read a
    copy in the work directory (fetched from the store on a hit); the job's `affinity.safetensors`
    artifact is that copy, published under the job's own key (deleting another job never takes it)."""

    def __init__(self, run: JobRun) -> None:
        self.run = run
        self.key = Storage.affinity_key(run.fingerprint, tenant=run.owner)
        self.path = run.work / AFFINITY_COPY
        self.computed_here = run.work / "affinity.computed"  # survives a crash between caching and recording

    def lookup(self) -> bool | None:
        if not self.path.is_file():
            if self.run.storage.objects.head(self.key) is None:
                return None
            self.run.storage.objects.fetch(self.key, self.path)
        return not self.computed_here.exists()

    def publish(self, produced: Path) -> None:
        self.computed_here.touch()
        produced.replace(self.path)
        with self.run.db.transaction() as session:
            self.run._owned(session)  # a run that lost the job leaves the cache alone
        if self.run.storage.objects.head(self.key) is None:  # else another job with the fingerprint won
            self.run.storage.publish(self.path, self.key, sha256=sha256_file(self.path))


class JobRun(Hooks):
    """One attempt at a job: the stages of models.stages, with this worker's lease, cancel checks,
    fencing and database recording as the runner's hooks."""

    def __init__(self, *, db: Database, settings: Settings, job: Job, spec: JobSpec, worker: str,
                 monitor: Monitor) -> None:
        self.db, self.settings, self.worker, self.monitor = db, settings, worker, monitor
        self.job_id, self.attempt, self.spec = job.id, job.attempts, spec
        self.lease = Lease(job.id, worker, job.attempts)
        self.fingerprint, self.owner = job.fingerprint, job.owner
        self.done: list[str] = list(job.stages_done or [])
        self.storage = Storage.from_settings(settings)
        self.work = self.storage.work_dir(job.id) / str(self.attempt)
        self.stage: str | None = None
        self._stage_t0 = self._stage_mono = 0.0
        self._trained = self._total_steps = 0  # the distilling stage's steps, for its ETA

    # -- bookkeeping --

    def check(self) -> None:
        if self.monitor.lost.is_set():
            raise LeaseLost(f"job {self.job_id}: lease lost to another worker")
        if self.monitor.cancel.is_set():
            raise JobCancelled(f"cancelled during {self.stage}")
        if self.monitor.stalled.is_set():
            raise JobStalled(f"stalled in stage {self.stage} for {self.monitor.silent_s():.0f} s "
                             f"(no progress; DTP_LAYOUT_STALL_S={self.settings.stall_s:g})")
        if self.monitor.over_time.is_set():
            raise TimeLimitExceeded(f"exceeded its time limit of {self.monitor.limits[0]:g} s in stage "
                                    f"{self.stage} (DTP_LAYOUT_TIME_LIMIT_S and TIME_LIMIT_PER_MTOKEN_S set it)")

    def should_stop(self) -> bool:
        """Between micro-batches: the flags the monitor read."""
        self.monitor.beat()
        if self.monitor.cancel.is_set():
            return True
        self.check()
        return False

    def progress(self, _name: str, fraction: float) -> None:
        if self.stage == "distilling":
            # Steps trained in this attempt set the pace: a resumed stage starts part-way.
            elapsed = time.monotonic() - self._stage_mono
            self.monitor.report(fraction, eta_s=elapsed / self._trained * self._total_steps * (1 - fraction)
                                if self._trained else None)
            return
        self.monitor.report(fraction)
        if self.stage == "exporting":
            self.check()

    def abandonable(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` (a download, loading weights, reading a calibration set: nothing in it checks our
        flags) in a thread and wait for it while checking them: a cancel, a lost lease or a stall ends
        the wait within a tick, leaving the thread to finish or hang on its own (its results go to this
        attempt's work directory, which no later attempt reads)."""
        box: dict[str, Any] = {}
        done = threading.Event()

        def target() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # re-raised in the job's thread
                box["error"] = exc
            finally:
                done.set()

        threading.Thread(target=target, name=f"{self.stage}-{self.job_id[:8]}", daemon=True).start()
        while not done.wait(min(0.25, self.monitor.tick)):
            self.check()
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _owned(self, session: Session) -> Job:
        """The job row, locked, if this run still holds it (the fence: same worker, same attempt)."""
        return self.lease.fence(session)

    def prepare_work(self) -> None:
        """This attempt's work directory, seeded with a copy of the latest earlier attempt's (finished
        stages' outputs and distillation checkpoints; not the exports, which are redone). A worker
        that lost the job keeps writing, if at all, into its own directory only."""
        parent = self.work.parent
        earlier = sorted((int(p.name) for p in parent.iterdir() if p.name.isdigit() and int(p.name) < self.attempt),
                         reverse=True) if parent.is_dir() else []
        shutil.rmtree(self.work, ignore_errors=True)
        skip = shutil.ignore_patterns("checkpoint", "shards", "distill-publish", "*.tmp", "*.tmp.npy")
        if earlier:
            shutil.copytree(parent / str(earlier[0]), self.work, ignore=skip)
            for n in earlier:
                shutil.rmtree(parent / str(n), ignore_errors=True)
        elif parent.is_dir():
            # A job started before per-attempt directories: its files are in work/ itself.
            legacy = [p for p in parent.iterdir() if not p.name.isdigit()]
            ignored = skip(str(parent), [p.name for p in legacy])
            for p in legacy:
                if p.name in ignored:
                    continue
                if p.is_dir():
                    shutil.copytree(p, self.work / p.name, ignore=skip)
                else:
                    self.work.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(p, self.work / p.name)
        self.work.mkdir(parents=True, exist_ok=True)

    def enter(self, stage: str, **note: Any) -> None:
        self.check()
        self.stage, self._stage_t0 = stage, time.perf_counter()
        logs.update(stage=stage)
        self.monitor.start_stage(stage)
        with self.db.transaction() as session:
            job = self._owned(session)
            job.stage, job.progress, job.eta_s, job.stage_started_at = stage, 0.0, None, utcnow()
            events.record(session, self.job_id, events.STAGE_START, stage=stage, attempt=job.attempts, **note)
        log.info("job %s: %s", self.job_id, stage)

    def complete(self, stage: str, also: Callable[[Session, Job], None] | None = None, **note: Any) -> None:
        """Record the stage as done (with whatever `also` writes) in one transaction."""
        seconds = time.perf_counter() - self._stage_t0
        with self.db.transaction() as session:
            job = self._owned(session)
            if also is not None:
                also(session, job)
            if stage not in (job.stages_done or []):
                job.stages_done = [*(job.stages_done or []), stage]
            job.timings = {**(job.timings or {}), stage: round((job.timings or {}).get(stage, 0.0) + seconds, 3)}
            job.progress, job.eta_s, job.updated_at = 1.0, 0.0, utcnow()
            events.record(session, self.job_id, events.STAGE_DONE, stage=stage, attempt=job.attempts,
                          seconds=round(seconds, 3), **note)
        if stage not in self.done:
            self.done.append(stage)

    def upload(self, files: list[tuple[str, str, Path]]) -> list[tuple[str, str, str, int, str]]:
        """(name, kind, key, size, sha256) of files about to be published: hashed and put in the store
        before the transaction that records their rows (the job row is not held locked while hashing or
        uploading, and a row is never visible before its object is whole). Each goes to this attempt's
        key (Storage.artifact_key): a run that lost the job can upload, but never over the winner's
        objects, and never records a row; what no row lists is swept."""
        with self.db.session() as session:
            have = set(session.scalars(select(Artifact.name).where(Artifact.job_id == self.job_id)).all())
        out = []
        for name, kind, path in files:
            if name in have:
                continue
            self.check()
            size, digest = path.stat().st_size, sha256_file(path)
            key = Storage.artifact_key(self.job_id, name, self.attempt)
            self.storage.publish(path, key, sha256=digest)
            out.append((name, kind, key, size, digest))
        return out

    def _artifact_rows(self, session: Session, files: list[tuple[str, str, str, int, str]]) -> None:
        """Add the rows of uploaded files (skipping names already recorded); called inside `complete`,
        after `_owned`: a run that lost the job records nothing."""
        have = set(session.scalars(select(Artifact.name).where(Artifact.job_id == self.job_id)).all())
        for name, kind, key, size, digest in files:
            if name in have:
                continue
            session.add(Artifact(job_id=self.job_id, name=name, kind=kind, size=size, sha256=digest,
                                 storage_key=key))

    def write_metrics(self, rows: list[dict[str, Any]]) -> None:
        """Evaluation rows (layout, seed, step, kl, ppl, loss, lr) into the metrics table, if this
        worker still holds the job (the job row's lock also serialises writers)."""
        with self.db.transaction() as session:
            self._owned(session)
            upsert_metrics(session, self.job_id, rows)

    # -- the stages: models.stages, run by models.runner with this run's hooks --

    def run(self) -> None:
        from models.heldout import source_identity

        self.check_quota()
        self.prepare_work()
        ctx = self.context()
        run_stages(STAGES, ctx, self, keep=REPORT_INPUTS)
        self.check()
        self.stage = None
        summary_file = self.work / "distill" / "summary.json"
        held_out = json.loads(summary_file.read_text()).get("data") if ctx.distill and summary_file.is_file() else None
        self._finish(stages_report(ctx, calibration_identity=source_identity(ctx.calibration.source,
                                                                             ctx.calibration.text_field),
                                   data=held_out))

    def check_quota(self) -> None:
        """Before the job writes anything: its tenant must be under its storage quota (checked at submit
        too; other jobs may have filled it since). Over it, the job fails naming the quota."""
        from app.core.errors import ApiError
        from app.core.usage import check_quota

        with self.db.session() as session:
            try:
                check_quota(session, settings=self.settings, tenant=self.owner, asked=0,
                            what="this job (its artifacts)")
            except ApiError as exc:
                raise ValueError(exc.detail) from None

    def upload_path(self, ref: str, *, kind: str, field: str) -> Path:
        """A local copy of the job's tenant's upload (the store's own files on a local store): the file of a
        one-file upload, else the directory."""
        from app.core.uploads import local_path

        return local_path(db=self.db, store=UploadStore(self.storage), ref=ref, tenant=self.owner, kind=kind,
                          field=field, cache=self.storage.root / "cache" / "uploads")

    def data_source(self, source: str, field: str) -> str:
        """What models.calibration reads for a spec's data source: an upload's local copy, a corpus, a hub
        dataset, or a name under the data root as its absolute path."""
        if source.startswith("upload:"):
            return str(self.upload_path(source, kind="data", field=field))
        return resolve_data(self.settings.data_dir, source, field=field)

    def model_location(self) -> ModelLocation:
        """Where the model is loaded from: an upload (its config checked again), else `prepare_model`."""
        spec = self.spec
        if not spec.model.id.startswith("upload:"):
            return prepare_model(settings=self.settings, spec=spec)
        from app.core.model_limits import check_model_config
        from app.core.sources import read_config

        location = ModelLocation(path=self.upload_path(spec.model.id, kind="model", field="model.id"))
        config = read_config(location)
        if config is not None and (problems := check_model_config(config, spec=spec, settings=self.settings)):
            raise SourceError(problems[0][0], "; ".join(f"{field}: {message}" for field, message in problems))
        return location

    def context(self) -> Any:
        """The job's spec in the stages' terms, its data sources resolved (refused now, before any work)."""
        from models import pipeline
        from models.calibration import CalibrationSpec
        from models.converted import ConvertedCache
        from models.loading import ModelSource
        from models.stages import RunContext

        spec = self.spec
        shown = CalibrationSpec(**spec.calibration.model_dump())
        calibration = CalibrationSpec(**{**spec.calibration.model_dump(),
                                         "source": self.data_source(spec.calibration.source, "calibration.source")})
        distill = self.distill_plan(calibration) if spec.distill is not None else None

        def source() -> ModelSource:
            # limits checked again; a hub id → its snapshot (a download: abandoned on cancel or stall)
            location = self.model_location()
            if location.path is None or not location.path.is_absolute():
                # Loaded by absolute path only: a name would be resolved against the working directory.
                raise SourceError("model.id", f"model {spec.model.id!r} did not resolve to a file under the "
                                              "model root or the hub cache")
            return ModelSource(**location.loader_args())

        return RunContext(
            run_dir=self.work, model_id=spec.model.id, source=source, dtype=spec.model.dtype,
            device=self.settings.device, devices=spec.devices, delta=spec.delta, schedule=spec.schedule,
            optimise=pipeline.OptimiseSpec(devices=spec.devices, delta=spec.delta, schedule=spec.schedule,
                                           score=spec.score,
                                           random_layouts=spec.random_layouts, ablations=spec.ablations,
                                           export=spec.export.any, batch_size=spec.batch_size,
                                           restarts=spec.restarts, stability=spec.stability,
                                           layout_independent_ok=True),
            calibration=calibration, calibration_shown=shown, checkpoint=spec.export.checkpoint,
            shards=spec.export.shards, export_dtype=spec.export.dtype, distill=distill,
            affinity=CachedAffinity(self), max_memory=self.settings.memory_limit(spec.max_memory),
            # Per tenant, as the affinity cache: which model a job names is its tenant's input, and finding
            # another tenant's copy (seconds instead of a dequantisation) would tell that someone ran it.
            # With a remote store the local directory is a cache of the store's copy (worker.converted_mirror).
            converted=ConvertedCache(self.storage.path(Storage.CONVERTED), namespace=tenant_scope(self.owner),
                                     mirror=None if self.storage.local else StoreMirror(self.storage.objects)))

    def distill_plan(self, calibration: Any) -> Any:
        """The spec's `distill` as a models.distill.DistillSpec over work/layouts into work/distill/, each
        evaluation written to the metrics table as it is produced."""
        from models import distill as D
        from models.calibration import CalibrationSpec
        from models.stages import DistillPlan

        spec = self.spec.distill
        assert spec is not None
        out_dir = self.work / "distill"
        data = {part: CalibrationSpec(**{**fields, "source": self.data_source(fields["source"],
                                                                              f"distill.{part}.source")})
                for part, fields in zip(("train", "eval"), spec.data_specs(self.spec.calibration), strict=True)}
        # spd:auto:K: its layers are chosen by the affinity stage; the distilling stage puts them in
        from_affinity = self.spec.schedule is not None and not parse_schedule(self.spec.schedule).resolvable
        dspec = D.DistillSpec(layouts=tuple(spec.layouts), train=data["train"], eval=data["eval"],
                              devices=self.spec.devices, delta=self.spec.delta, seeds=tuple(spec.seeds),
                              recipe=D.DistillRecipe.from_dict(spec.recipe_fields()), calibration=calibration,
                              allow_overlap=spec.allow_overlap, world_size=spec.world_size,
                              schedule=None if from_affinity else self.spec.schedule)
        self._total_steps = len(dspec.layouts) * len(dspec.seeds) * dspec.recipe.steps

        def on_step(_layout: str, _seed: int, _stats: Any, _last: Any) -> None:
            self._trained += 1

        def on_eval(record: Any) -> None:
            self.write_metrics([record.as_dict()])

        def on_run_start(_layout: str, _seed: int) -> None:
            # Evaluations read back from earlier attempts (finished runs, checkpoints) are in metrics.csv.
            self.write_metrics(read_metrics_csv(out_dir / "metrics.csv"))

        return DistillPlan(spec=dspec, out_dir=out_dir, layouts_dir=self.work / "layouts", plot=True,
                           keep_checkpoints=False, on_eval=on_eval, on_step=on_step, on_run_start=on_run_start)

    # -- the hooks (models.runner.Hooks) --

    def is_done(self, stage: Any) -> bool:
        return stage.name in self.done

    def skipped(self, stage: Any) -> None:
        log.info("job %s: %s was done by an earlier attempt", self.job_id, stage.name)

    def before(self, stage: Any) -> None:
        # The device this attempt runs on is recorded with its first stage (the job view's `device`).
        note = ({"device": prepare_device(self.settings.device, self.settings.cuda_memory_fraction)}
                if stage.name == "loading" else {})
        self.enter(stage.name, **note)
        self._trained, self._stage_mono = 0, time.monotonic()

    def execute(self, stage: Any, fn: Callable[[], Any]) -> Any:
        """A stage that polls should_stop runs here; any other in a thread a cancel walks away from
        (loading weights, reading a calibration set or writing a large checkpoint report nothing for minutes)."""
        note = fn() if stage.checks_stop else self.abandonable(fn)
        self.check()
        return note

    def after(self, stage: Any, note: dict[str, Any], seconds: float) -> None:
        record = {"affinity": self._record_affinity, "optimising": self._record_layouts,
                  "stability": self._record_stability, "exporting": self._record_export,
                  "distilling": self._record_distill}.get(stage.name)
        if record is None:
            self.complete(stage.name, **note)
        else:
            record(note)

    def _record_affinity(self, note: dict[str, Any]) -> None:
        from models.run_files import AFFINITY_FILE

        published = self.upload([(AFFINITY_FILE, "affinity", self.work / AFFINITY_COPY)])

        def record(session: Session, job: Job) -> None:
            job.affinity_cached = note["cached"]
            self._artifact_rows(session, published)

        self.complete("affinity", record, **note)

    def _record_layouts(self, note: dict[str, Any]) -> None:
        from models.layouts.layout import load

        layouts = [load(p) for p in sorted((self.work / "layouts").glob("*.json"))]

        def record(session: Session, _job: Job) -> None:
            have = set(session.scalars(select(LayoutRow.name).where(LayoutRow.job_id == self.job_id)).all())
            for lay in layouts:
                if lay.name not in have:
                    session.add(_layout_row(self.job_id, lay))

        self.complete("optimising", record, **note)

    def _record_stability(self, note: dict[str, Any]) -> None:
        from models.run_files import STABILITY_FILE

        # Published once the job succeeds, inside report.json (and the job's summary).
        assert (self.work / STABILITY_FILE).is_file()
        self.complete("stability", **note)

    def _record_export(self, note: dict[str, Any]) -> None:
        from models.run_files import EXPORT_DIRS

        files = [(f"{sub}/{p.name}", sub, p) for sub in EXPORT_DIRS
                 for p in sorted((self.work / sub).glob("*")) if p.is_file()]
        published = self.upload(files)
        self.complete("exporting", lambda session, _job: self._artifact_rows(session, published),
                      **note, files=len(files))

    def _record_distill(self, note: dict[str, Any]) -> None:
        """summary.json with the data specs as submitted, then the files published and the metrics
        upserted with the stage."""
        out_dir = self.work / "distill"
        assert self.spec.distill is not None
        shown = dict(zip(("train", "eval"), self.spec.distill.data_specs(self.spec.calibration), strict=True))
        summary_file = out_dir / "summary.json"
        summary = json.loads(summary_file.read_text())
        for part, fields in shown.items():
            # the blocks actually read (held-out placement may have moved them), under the submitted name
            summary[part] = {**fields, **summary.get(part, {}), "source": fields["source"]}
        _write_json(summary_file, summary)
        staging = self.work / "distill-publish"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        files = []
        for name in DISTILL_FILES:
            shutil.copyfile(out_dir / name, staging / name)  # the work directory keeps its copy
            files.append((f"distill/{name}", "distill", staging / name))

        published = self.upload(files)

        def record(session: Session, _job: Job) -> None:
            upsert_metrics(session, self.job_id, read_metrics_csv(out_dir / "metrics.csv"))
            self._artifact_rows(session, published)

        # steps_trained < total_steps: this attempt resumed from finished runs or checkpoints.
        self.complete("distilling", record, **note, steps_trained=self._trained)
        shutil.rmtree(staging, ignore_errors=True)

    def _finish(self, report: dict[str, Any]) -> None:
        report_file = self.work / "report.json"
        with self.db.session() as session:
            job = session.get(Job, self.job_id)
            assert job is not None
            report["seconds"] = dict(job.timings or {})
            report["job"] = {"id": self.job_id, "fingerprint": self.fingerprint,
                             "affinity_cached": bool(job.affinity_cached)}
        _write_json(report_file, report)
        published = self.upload([("report.json", "report", report_file)])
        with self.db.transaction() as session:
            job = self._owned(session)
            self._artifact_rows(session, published)
            job.summary = {key: report.get(key) for key in ("tokens", "random_expectation", "upper_bound",
                                                             "upper_bound_exact", "notes")}
            job.summary["layouts"] = {name: rep["J"] for name, rep in report["layouts"].items()}
            if "stability" in report:
                job.summary["stability"] = report["stability"]
            distilled = self.work / "distill" / "summary.json"
            if self.spec.distill is not None and distilled.is_file():
                doc = json.loads(distilled.read_text())
                job.summary["distill"] = {"dense_ppl": doc.get("dense_ppl"), "headline": doc.get("headline"),
                                          "world_size": doc.get("world_size", 1), "summary": DISTILL_SUMMARY}
            now = utcnow()
            job.status, job.stage, job.progress, job.eta_s = "succeeded", None, 1.0, None
            job.finished_at, job.updated_at, job.lease_until = now, now, None
            events.record(session, self.job_id, "succeeded", attempt=job.attempts)
        log.info("job %s: succeeded", self.job_id)


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


def read_metrics_csv(path: Path) -> list[dict[str, Any]]:
    """The rows of a distillation metrics.csv (layout, seed, step, kl, ppl, loss, lr); [] when absent."""
    try:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    except FileNotFoundError:
        return []


METRIC_BATCH = 1000  # rows per query: the IN lists and inserts stay far below the bind-parameter limits
# (SQLite 32766, Postgres 65535) however long the distillation


def upsert_metrics(session: Session, job_id: str, rows: list[dict[str, Any]]) -> None:
    """One `metrics` row per (job, layout, seed, step, name): an existing row is updated, a missing one
    inserted; empty and non-finite values (the loss at step 0) are not written. In batches of
    METRIC_BATCH rows, flushed one by one (same transaction)."""
    for i in range(0, len(rows), METRIC_BATCH):
        _upsert_metric_batch(session, job_id, rows[i:i + METRIC_BATCH])
        session.flush()


def _upsert_metric_batch(session: Session, job_id: str, rows: list[dict[str, Any]]) -> None:
    """Existing rows read back by key, then the new ones inserted and the changed ones updated, each
    as one executemany (no ORM object per row: a long distillation has hundreds of thousands)."""
    if not rows:
        return
    keyed = [(str(r["layout"]), int(r["seed"]), int(r["step"]), r) for r in rows]
    steps = [k[2] for k in keyed]  # a range, not a list of steps: few parameters, the unique index serves it
    query = select(Metric.id, Metric.layout, Metric.seed, Metric.step, Metric.name, Metric.value).where(
        Metric.job_id == job_id, Metric.layout.in_({k[0] for k in keyed}), Metric.seed.in_({k[1] for k in keyed}),
        Metric.step.between(min(steps), max(steps)))
    existing: dict[tuple[str | None, int, int, str], tuple[int | None, float]] = {
        (m.layout, m.seed, m.step, m.name): (m.id, m.value) for m in session.execute(query)}
    inserts: dict[tuple[str | None, int, int, str], dict[str, Any]] = {}
    updates: dict[int, float] = {}
    for layout, seed, step, row in keyed:
        for name in METRIC_NAMES:
            raw = row.get(name)
            if raw is None or raw == "":
                continue
            value = float(raw)
            if not math.isfinite(value):
                continue
            key = (layout, seed, step, name)
            have = existing.get(key)
            if have is None:
                inserts[key] = {"job_id": job_id, "layout": layout, "seed": seed, "step": step, "name": name,
                                "value": value, "created_at": utcnow()}
            elif have[0] is not None and have[1] != value:
                updates[have[0]] = value
    if inserts:
        session.execute(insert(Metric), list(inserts.values()))
    if updates:
        session.execute(update(Metric), [{"id": i, "value": v} for i, v in updates.items()])


def _layout_row(job_id: str, lay: Any) -> LayoutRow:
    from dataclasses import asdict

    score = lay.score or {}
    return LayoutRow(job_id=job_id, name=lay.name, J=float(score["J"]),
                     random_expectation=float(score["random_expectation"]),
                     upper_bound=float(score["upper_bound"]), upper_bound_exact=bool(score["upper_bound_exact"]),
                     # None for a layer whose edge the schedule does not have (spd:B's other layers)
                     up_fraction=[None if x is None else float(x) for x in score["up_fraction"]],
                     down_fraction=[None if x is None else float(x) for x in score["down_fraction"]],
                     kv_group_device=lay.kv_group_device.tolist(), neuron_device=lay.neuron_device.tolist(),
                     shape=asdict(lay.shape), score=score)


def _end(db: Database, lease: Lease, *, status: str, error: str | None, stage: str | None) -> bool:
    """Mark the job failed or cancelled, if this lease still holds it."""
    with db.transaction() as session:
        job = lease.held(session)
        if job is None:
            return False
        now = utcnow()
        stage = stage or job.stage
        job.status, job.error, job.error_stage = status, error, stage if status == "failed" else None
        job.stage = stage
        job.finished_at, job.updated_at, job.lease_until, job.eta_s = now, now, None, None
        events.record(session, lease.job_id, status, stage=stage, attempt=job.attempts, error=error)
    return True


def _retry(db: Database, lease: Lease, *, reason: str, stage: str | None, max_attempts: int,
           enqueue: Callable[[str], None] | None) -> str:
    """This run was abandoned (it stalled): back to `queued` and sent again, or `failed` once the job
    has had `max_attempts` runs. A lost message is found by the queued sweeper."""
    if lease.attempt >= max_attempts:
        _end(db, lease, status="failed", stage=stage, error=f"gave up after {lease.attempt} attempts: {reason}")
        return "failed"
    with db.transaction() as session:
        job = lease.held(session)
        if job is None:
            return "lost"
        job.status, job.worker, job.lease_until, job.eta_s = "queued", None, None, None
        job.enqueued_at, job.requeues, job.updated_at = db_now(), (job.requeues or 0) + 1, utcnow()
        events.record(session, lease.job_id, events.REQUEUED, reason=reason, stage=stage, attempt=lease.attempt,
                      requeues=job.requeues)
    if enqueue is not None:
        try:
            enqueue(lease.job_id)
        except Exception:
            log.exception("job %s: could not re-enqueue it; the queued sweeper will", lease.job_id)
    return "retried"


MAX_ERROR_CHARS = 2000
_JOB_DIR = re.compile(r"jobs/([0-9a-f]{32})")
_CACHE_DIR = re.compile(r"(affinity|converted)/([^/\s'\"]+)/")  # the per-tenant caches


def public_error(message: str, *, job_id: str, tenant: str | None) -> str:
    """The error text stored on the job (what its tenant reads): bounded, and without the names of other
    jobs' directories or other tenants' cache entries, should a message ever carry one. The whole text
    goes to the worker's log when anything was cut."""
    shown = _JOB_DIR.sub(lambda m: m.group(0) if m.group(1) == job_id else "jobs/…", message)
    own = tenant_scope(tenant)
    shown = _CACHE_DIR.sub(lambda m: m.group(0) if m.group(2) == own else f"{m.group(1)}/…/", shown)
    if len(shown) > MAX_ERROR_CHARS:
        shown = shown[:MAX_ERROR_CHARS] + " … (cut: the rest is in the worker's log)"
    if shown != message:
        log.warning("job %s: the error, as stored for its tenant, was cut or masked; in full: %s", job_id, message)
    return shown


def user_errors() -> tuple[type[BaseException], ...]:
    from models.assets import AssetNotFoundError
    from models.export import ExportError

    return (ValueError, AssetNotFoundError, ExportError, OSError)


def run_job(job_id: str, *, settings: Settings, db: Database, worker: str,
            enqueue: Callable[[str], None] | None = None, on_hard_limit: Callable[[], None] | None = None) -> str:
    """Claim and run the job; returns what happened: skipped, succeeded, failed, cancelled, retried
    (the run stalled; the job is queued again) or lost (another run holds the job now)."""
    from pydantic import ValidationError

    job = claim(db, job_id, worker=worker, lease_s=settings.lease_s)
    if job is None:
        log.info("job %s: nothing to do (finished, cancelled or leased by a live worker)", job_id)
        return "skipped"
    lease = Lease(job_id, worker, job.attempts)
    with db.session() as session:
        logs.update(**job_log_fields(session, job))
        last_reason = events.last_requeue_reason(session, job_id) if lease.attempt > settings.max_attempts else None
    if job.cancel_requested:
        _end(db, lease, status="cancelled", error="cancelled by request", stage=job.stage)
        return "cancelled"
    if lease.attempt > settings.max_attempts:
        _end(db, lease, status="failed", stage=job.stage,
             error=f"gave up after {settings.max_attempts} attempts: {last_reason or 'the worker was lost each time'}")
        return "failed"
    runner: JobRun | None = None
    monitor: Monitor | None = None
    try:
        # The stored spec is validated again before anything runs (the schema may have changed since
        # it was accepted); one that no longer validates fails the job, with the reason.
        try:
            spec = JobSpec.model_validate(job.spec)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'spec'}: {e['msg']}" for e in exc.errors()[:5])
            raise ValueError(f"the stored job spec no longer validates: {problems}") from exc
        from app.core.budgets import work_tokens

        limits = settings.time_limits(work_tokens(spec))

        def hard_limit() -> None:
            # The run never reached a check (stuck in native code): record why, then the caller's
            # action (the Celery task kills its own process, as Celery's hard limit kills a pool process).
            assert monitor is not None
            if on_hard_limit is None or monitor.hard_hit.is_set():
                return
            monitor.hard_hit.set()
            _end(db, lease, status="failed", stage=monitor.stage,
                 error=f"exceeded its hard time limit of {limits[1]:g} s in stage {monitor.stage}; the worker "
                       "process was killed")
            log.error("job %s: hard time limit exceeded in %s", job_id, monitor.stage)
            on_hard_limit()

        monitor = Monitor(db, lease, settings.lease_s, stall_s=settings.stall_s, limits=limits,
                          on_hard_limit=hard_limit)
        runner = JobRun(db=db, settings=settings, job=job, spec=spec, worker=worker, monitor=monitor)
        monitor.start()
        # After the monitor renews the lease: forgetting imports models.heldout (and so torch), which
        # can take longer than a short lease on a loaded machine, and a sweeper would requeue the job.
        _forget_earlier_reads()
        from models.calibration import set_tokenizer_limits

        set_tokenizer_limits(settings.tokenizer_limits())  # the tokenizer's child process (models.sandbox)
        runner.run()
        return "succeeded"
    except LeaseLost:
        log.warning("job %s: lease lost; leaving it to the worker that holds it", job_id)
        return "lost"
    except JobStalled as exc:
        stage = runner.stage if runner is not None else job.stage
        log.warning("job %s: %s", job_id, exc)
        return _retry(db, lease, reason=str(exc), stage=stage, max_attempts=settings.max_attempts,
                      enqueue=enqueue)
    except Exception as exc:
        from models.affinity import Cancelled

        stage = runner.stage if runner is not None else job.stage
        if isinstance(exc, JobCancelled | Cancelled):
            _end(db, lease, status="cancelled", error="cancelled by request", stage=stage)
            return "cancelled"
        if database_unreachable(exc):  # nothing can be recorded: the lease expires, a sweeper retries it
            log.warning("job %s: the database became unreachable during %s; left to be retried when it is back",
                        job_id, stage)
            return "retried"
        if disk_full(exc, settings.storage):
            log.error("job %s: the storage volume is full (%s): %s", job_id, stage, exc)
            if _end(db, lease, status="failed", error=no_space_message(stage, settings.storage), stage=stage):
                remove_work(Storage(settings.storage).work_dir(job_id))  # once ended by us: no attempt resumes
            return "failed"
        oom = out_of_memory_message(exc, stage=stage)
        if oom is not None:
            message = oom
            log.error("job %s: %s", job_id, oom)
        elif isinstance(exc, (*user_errors(), TimeLimitExceeded)):
            message = str(exc)
        else:
            message = f"{type(exc).__name__}: {exc}"
            log.error("job %s failed in %s:\n%s", job_id, stage, traceback.format_exc())
        _end(db, lease, status="failed", error=public_error(message, job_id=job_id, tenant=job.owner), stage=stage)
        return "failed"
    finally:
        if monitor is not None:
            monitor.stop()
        del runner
        _release_memory()


def _forget_earlier_reads() -> None:
    """Empty the process's caches of what earlier jobs read (GGUF metadata, content hashes of data
    files): a job's speed must not tell its tenant what another tenant's job named."""
    from models.heldout import forget_hashes

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
