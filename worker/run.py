"""One attempt at a job (`JobRun`): the stages of `models/run/stages.py` run by `models.run.runner` with this worker's
hooks — the lease, cancel checks and fencing, the stage rows, the job's plan (`models.run.plan.plan_run`, its data
sources resolved). What the run publishes (each finished stage's uploads and rows, the report) is its `Publisher`'s
(worker/publishing.py): the run records each stage with what its publisher hands back. Torch is imported inside
the methods that need it."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from app.core import events, logs
from app.core.db import Database, Job, utcnow
from app.core.hub import prepare_model
from app.core.lease import Lease, LeaseLost
from app.core.schemas.jobs import JobSpec
from app.core.services.sources import ModelLocation, SourceError, resolve_data
from app.core.settings import Settings
from app.core.storage.root import Storage, tenant_scope
from app.core.storage.uploads import UploadStore
from models.base.progress import StopSignal, stopped_by
from models.data.source import is_upload
from models.run.runner import Hooks, run_stages
from models.run.stages import REPORT_INPUTS, STAGES
from models.run.stages import build_report as stages_report
from worker.converted_mirror import StoreMirror
from worker.device import prepare_device
from worker.metrics import read_metrics_csv, upsert_metrics
from worker.monitor import SHUTTING_DOWN, JobStalled, Monitor, TimeLimitExceeded, WorkerShuttingDown
from worker.publishing import CachedAffinity, Publisher

log = logging.getLogger("dtp_layout.worker")
# While a stopped stage's work winds down (to its next safe point), a line in the log this often.
STOP_WAIT_LOG_S = 10.0


class JobCancelled(RuntimeError):
    pass


class JobRun(Hooks):
    """One attempt at a job: the stages of models.run.stages, with this worker's lease, cancel checks,
    fencing and the stage rows as the runner's hooks; its publisher uploads and records what they produce."""

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
        # Set (with the reason) when the run must end: read at the safe points of the stages' work
        # (models.base.progress.check_stop) and by the sandbox, which kills the work's child processes.
        self.stop = StopSignal()
        self._stage_t0 = self._stage_mono = 0.0
        self._trained = self._total_steps = 0  # the distilling stage's steps, for its ETA
        self.publisher = Publisher(db=db, settings=settings, storage=self.storage, spec=spec, lease=self.lease,
                                   owner=self.owner, fingerprint=self.fingerprint, work=self.work, check=self.check)

    # -- bookkeeping --

    def check(self) -> None:
        """Raise why the run must end, if it must (its stop signal set with the reason)."""
        reason = self._ended_by()
        if reason is not None:
            self.stop.set(str(reason))
            raise reason

    def _ended_by(self) -> Exception | None:
        if self.monitor.lost.is_set():
            return LeaseLost(f"job {self.job_id}: lease lost to another worker")
        if self.monitor.cancel.is_set():
            return JobCancelled(f"cancelled during {self.stage}")
        if self.monitor.stalled.is_set():
            return JobStalled(f"stalled in stage {self.stage} for {self.monitor.silent_s():.0f} s "
                              f"(no progress; DTP_LAYOUT_STALL_S={self.settings.stall_s:g})")
        if self.monitor.over_time.is_set():
            return TimeLimitExceeded(f"exceeded its time limit of {self.monitor.limits[0]:g} s in stage "
                                     f"{self.stage} (DTP_LAYOUT_TIME_LIMIT_S and TIME_LIMIT_PER_MTOKEN_S set it)")
        if SHUTTING_DOWN.is_set():
            return WorkerShuttingDown(f"the worker shut down during {self.stage}")
        return None

    def should_stop(self) -> bool:
        """Between micro-batches: the flags the monitor read."""
        self.monitor.beat()
        if self.monitor.cancel.is_set():
            self.stop.set(f"cancelled during {self.stage}")  # anything else of the run's work stops too
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
        """Run `fn` (a download, loading weights, reading a calibration set: work that does not poll
        should_stop) in a thread under this run's stop signal, and wait for it while checking the flags.
        A cancel, a lost lease, a stall, a time limit or the worker's shutdown sets the signal: the work
        stops at its next safe point (models.base.progress.check_stop; the sandbox kills its child
        process group at once) and only then does the run end. Until the thread has stopped, the job
        holds this worker: abandoned work never overlaps the next job (a thread stuck in native code
        for good ends with the process, at the hard time limit)."""
        box: dict[str, Any] = {}
        done = threading.Event()

        def target() -> None:
            with stopped_by(self.stop):
                try:
                    box["value"] = fn()
                except BaseException as exc:  # re-raised in the job's thread
                    box["error"] = exc
                finally:
                    done.set()

        threading.Thread(target=target, name=f"{self.stage}-{self.job_id[:8]}", daemon=True).start()
        while not done.wait(min(0.25, self.monitor.tick)):
            try:
                self.check()
            except Exception:
                self._wait_stopped(done)
                raise
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _wait_stopped(self, done: threading.Event) -> None:
        """Wait for the stopped work's thread to end (its next safe point), saying so while it lasts."""
        t0 = time.monotonic()
        while not done.wait(STOP_WAIT_LOG_S):
            log.warning("job %s: %s: waiting %.0f s for the work of stage %s to reach a safe point and stop",
                        self.job_id, self.stop.reason, time.monotonic() - t0, self.stage)
        log.info("job %s: the work of stage %s stopped %.2f s after it was told to (%s)", self.job_id, self.stage,
                 time.monotonic() - t0, self.stop.reason)

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
            job = self.lease.fence(session)
            job.stage, job.progress, job.eta_s, job.stage_started_at = stage, 0.0, None, utcnow()
            events.record(session, self.job_id, events.STAGE_START, stage=stage, attempt=job.attempts, **note)
        log.info("job %s: %s", self.job_id, stage)

    def complete(self, stage: str, also: Callable[[Session, Job], None] | None = None, **note: Any) -> None:
        """Record the stage as done (with whatever `also` writes) in one transaction."""
        seconds = time.perf_counter() - self._stage_t0
        with self.db.transaction() as session:
            job = self.lease.fence(session)
            if also is not None:
                also(session, job)
            if stage not in (job.stages_done or []):
                job.stages_done = [*(job.stages_done or []), stage]
            job.timings = {**(job.timings or {}), stage: round((job.timings or {}).get(stage, 0.0) + seconds, 3)}
            job.progress, job.eta_s, job.updated_at = 1.0, 0.0, utcnow()
            events.record(session, self.job_id, events.STAGE_DONE, stage=stage, attempt=job.attempts,
                          seconds=round(seconds, 3), **note)
        self.monitor.stage_done()
        if stage not in self.done:
            self.done.append(stage)

    def write_metrics(self, rows: list[dict[str, Any]]) -> None:
        """Evaluation rows (layout, seed, step, kl, ppl, loss, lr) into the metrics table, if this
        worker still holds the job (the job row's lock also serialises writers)."""
        with self.db.transaction() as session:
            self.lease.fence(session)
            upsert_metrics(session, self.job_id, rows)

    # -- the stages: models.run.stages, run by models.run.runner with this run's hooks --

    def run(self) -> None:
        from models.data.heldout import source_identity

        self.check_quota()
        self.prepare_work()
        ctx = self.context()
        with stopped_by(self.stop):  # the stages run in this thread (those that poll) answer to it too
            run_stages(STAGES, ctx, self, keep=REPORT_INPUTS)
        self.check()
        self.stage = None
        summary_file = self.work / "distill" / "summary.json"
        held_out = json.loads(summary_file.read_text()).get("data") if ctx.distill and summary_file.is_file() else None
        self.publisher.report(stages_report(ctx, calibration_identity=source_identity(ctx.calibration.source,
                                                                             ctx.calibration.text_field),
                                   data=held_out))

    def check_quota(self) -> None:
        """Before the job writes anything: its tenant must be under its storage quota (checked at submit
        too; other jobs may have filled it since). Over it, the job fails naming the quota."""
        from app.core.errors import ApiError
        from app.core.services.usage import check_quota

        with self.db.session() as session:
            try:
                check_quota(session, settings=self.settings, tenant=self.owner, asked=0,
                            what="this job (its artifacts)")
            except ApiError as exc:
                raise ValueError(exc.detail) from None

    def upload_path(self, ref: str, *, kind: str, field: str) -> Path:
        """A local copy of the job's tenant's upload (the store's own files on a local store): the file of a
        one-file upload, else the directory."""
        from app.core.services.uploads import local_path

        return local_path(db=self.db, store=UploadStore(self.storage), ref=ref, tenant=self.owner, kind=kind,
                          field=field, cache=self.storage.root / "cache" / "uploads")

    def data_source(self, source: str, field: str) -> str:
        """What models.data.calibration reads for a spec's data source: an upload's local copy, a corpus, a hub
        dataset, or a name under the data root as its absolute path."""
        if is_upload(source):
            return str(self.upload_path(source, kind="data", field=field))
        return resolve_data(self.settings.data_dir, source, field=field)

    def model_location(self) -> ModelLocation:
        """Where the model is loaded from: an upload (its config checked again), else `prepare_model`."""
        spec = self.spec
        if not is_upload(spec.model.id):
            return prepare_model(settings=self.settings, spec=spec)
        from app.core.hub import check_local_model

        # a GGUF's header and tensor table strictly (issue 41): one the bounded reader refuses is never loaded
        location = ModelLocation(path=self.upload_path(spec.model.id, kind="model", field="model.id"))
        return check_local_model(location, settings=self.settings, spec=spec)

    def context(self) -> Any:
        """The job's run: its plan (models.run.plan.plan_run: the stages and their parameters, from the spec, its
        data sources resolved; what the run would refuse is refused now, before any work) and this worker's
        places, stores and callbacks."""
        from models.io.loading import ModelSource
        from models.run.plan import plan_run
        from models.run.stages import RunContext
        from worker.derived_data import OwnedConvertedCache, converted_recorder

        spec = self.spec
        plan = plan_run(spec, data=self.data_source, max_memory=self.settings.memory_limit(spec.max_memory),
                        layout_independent_ok=True)

        def source() -> ModelSource:
            # limits checked again; a hub id → its snapshot (a download: abandoned on cancel or stall)
            location = self.model_location()
            if location.path is None or not location.path.is_absolute():
                # Loaded by absolute path only: a name would be resolved against the working directory.
                raise SourceError("model.id", f"model {spec.model.id!r} did not resolve to a file under the "
                                              "model root or the hub cache")
            return ModelSource(**location.loader_args())

        return RunContext.of(
            plan, run_dir=self.work, source=source, device=self.settings.device,
            distill_output=self.distill_output() if plan.distill is not None else None,
            affinity=CachedAffinity(self.publisher),
            # Per tenant, as the affinity cache: which model a job names is its tenant's input, and finding
            # another tenant's copy (seconds instead of a dequantisation) would tell that someone ran it.
            # With a remote store the local directory is a cache of the store's copy (worker.converted_mirror).
            # Each entry loaded is recorded with its owner and needers (worker.derived_data).
            converted=OwnedConvertedCache(
                self.storage.path(Storage.CONVERTED), namespace=tenant_scope(self.owner),
                mirror=None if self.storage.local else StoreMirror(self.storage.objects),
                on_entry=converted_recorder(self.db, owner=self.owner, namespace=tenant_scope(self.owner),
                                            job_id=self.job_id, model_id=spec.model.id)))

    def distill_output(self) -> Any:
        """Where the distilling stage writes (work/distill/) and reads the job's layouts (work/layouts), each
        evaluation written to the metrics table as it is produced."""
        from models.run.stages import DistillOutput

        distill = self.spec.distill
        assert distill is not None
        out_dir = self.work / "distill"
        recipe = distill.effective_recipe()
        self._total_steps = len(distill.layouts) * len(distill.seeds) * recipe["steps"]

        def on_step(_layout: str, _seed: int, _stats: Any, _last: Any) -> None:
            self._trained += 1

        def on_eval(record: Any) -> None:
            self.write_metrics([record.as_dict()])

        def on_run_start(_layout: str, _seed: int) -> None:
            # Evaluations read back from earlier attempts (finished runs, checkpoints) are in metrics.csv.
            self.write_metrics(read_metrics_csv(out_dir / "metrics.csv"))

        return DistillOutput(out_dir=out_dir, layouts_dir=self.work / "layouts", plot=True, keep_checkpoints=False,
                             on_eval=on_eval, on_step=on_step, on_run_start=on_run_start)

    # -- the hooks (models.run.runner.Hooks) --

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

    def after(self, stage: Any, note: dict[str, Any], seconds: float) -> None:
        """The stage's outputs published (`Publisher.stage`), then the stage recorded with their rows."""
        record = self.publisher.stage(stage.name, note)
        extra = dict(record.note)
        if stage.name == "distilling":
            # steps_trained < total_steps: this attempt resumed from finished runs or checkpoints.
            extra["steps_trained"] = self._trained
        self.complete(stage.name, record.rows, **note, **extra)

    def execute(self, stage: Any, fn: Callable[[], Any]) -> Any:
        """A stage that polls should_stop runs here; any other in a thread that stops at its safe points
        (`abandonable`: loading weights, reading a calibration set or writing a large checkpoint report
        nothing for minutes)."""
        note = fn() if stage.checks_stop else self.abandonable(fn)
        self.check()
        return note
