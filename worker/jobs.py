"""Running one job: the stages of `models/pipeline.py`, resumable, idempotent and cancellable.

A job is leased by the worker that claims it (`worker`, `lease_until`); a monitor thread renews the
lease about every second, writes progress and reads the cancel flag. A worker that dies stops
renewing; any worker's sweeper then re-enqueues the job, and the next run resumes after the last
stage recorded in `stages_done`:

- loading      model and tokenizer (re-done on resume: they live in memory);
- calibration  token blocks → work/blocks.npy;
- affinity     → STORAGE_ROOT/affinity/<fingerprint>/affinity.safetensors, shared by every job with
               the same fingerprint (a later job reuses it: `affinity_cached`);
- optimising   layouts → work/layouts/*.json and the `layouts` rows, in one transaction with the stage;
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
import shutil
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from app.db import Artifact, Database, Job, LayoutRow, Metric, utcnow
from app.hub import prepare_model
from app.schemas import METRIC_NAMES, JobSpec
from app.services import DISTILL_SUMMARY, event
from app.settings import Settings
from app.sources import resolve_data
from app.storage import Storage, sha256_file
from worker.device import out_of_memory_message, prepare_device
from worker.outages import database_unreachable, disk_full, no_space_message, remove_work

log = logging.getLogger("dtp_layout.worker")
DISTILL_FILES = ("metrics.csv", "summary.json", "curves.png")
_AUTO: Any = object()  # Monitor.report: estimate the ETA from the stage's elapsed time


class LeaseLost(RuntimeError):
    """Another worker took the job over (this one was presumed dead): stop without writing."""


class JobCancelled(RuntimeError):
    pass


# ---- claiming and recovery -------------------------------------------------------------------------

def claim(db: Database, job_id: str, *, worker: str, lease_s: float) -> Job | None:
    """Atomically take a queued job, or a running one whose lease expired. None: nothing to do."""
    now = utcnow()
    with db.transaction() as session:
        result = session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status.in_(("queued", "running")),
                   or_(Job.lease_until.is_(None), Job.lease_until < now))
            .values(status="running", worker=worker, lease_until=now + timedelta(seconds=lease_s),
                    attempts=Job.attempts + 1, updated_at=now)
            .execution_options(synchronize_session=False)
        )
        if result.rowcount != 1:  # type: ignore[attr-defined]
            return None
        job = session.get(Job, job_id, populate_existing=True)
        assert job is not None
        job.started_at = job.started_at or now
        job.history = [*(job.history or []), event("claimed", worker=worker, attempt=job.attempts)]
    return job


def requeue_stale(db: Database, send: Callable[[str], None]) -> list[str]:
    """Re-enqueue running jobs whose worker stopped renewing the lease. Clearing the lease is the
    atomic step, so that of several sweeping workers exactly one re-sends a job."""
    now = utcnow()
    with db.session() as session:
        stale = session.scalars(select(Job.id).where(Job.status == "running", Job.lease_until < now)).all()
    sent = []
    for job_id in stale:
        with db.transaction() as session:
            result = session.execute(
                update(Job).where(Job.id == job_id, Job.status == "running", Job.lease_until < now)
                .values(lease_until=None, updated_at=utcnow()).execution_options(synchronize_session=False))
            if result.rowcount != 1:  # type: ignore[attr-defined]
                continue
            job = session.get(Job, job_id, populate_existing=True)
            if job is not None:
                job.history = [*(job.history or []), event("requeued", reason="lease expired")]
        try:
            send(job_id)
            sent.append(job_id)
        except Exception:
            log.exception("could not re-enqueue job %s; the next sweep retries", job_id)
            with db.transaction() as session:
                session.execute(update(Job).where(Job.id == job_id, Job.lease_until.is_(None))
                                .values(lease_until=now).execution_options(synchronize_session=False))
    return sent


# ---- the monitor thread ----------------------------------------------------------------------------

class Monitor(threading.Thread):
    """Renews the lease, writes progress and ETA (at most once per tick) and reads the cancel flag."""

    def __init__(self, db: Database, job_id: str, worker: str, lease_s: float) -> None:
        super().__init__(name=f"monitor-{job_id[:8]}", daemon=True)
        self.db, self.job_id, self.worker, self.lease_s = db, job_id, worker, lease_s
        self.tick = max(0.05, min(1.0, lease_s / 3))
        self.cancel = threading.Event()
        self.lost = threading.Event()
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self._fraction: float | None = None
        self._eta: float | None = _AUTO
        self._stage_t0 = time.monotonic()

    def start_stage(self) -> None:
        with self._lock:
            self._fraction, self._eta, self._stage_t0 = None, _AUTO, time.monotonic()

    def report(self, fraction: float, eta_s: float | None = _AUTO) -> None:
        """The stage's fraction done; eta_s when the caller knows better than elapsed·(1 − f)/f (a
        resumed stage starts part-way), None for not known yet."""
        with self._lock:
            self._fraction, self._eta = min(1.0, max(0.0, float(fraction))), eta_s

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
        now = utcnow()
        values = {"lease_until": now + timedelta(seconds=self.lease_s), "updated_at": now, **self._progress()}
        with self.db.transaction() as session:
            result = session.execute(
                update(Job).where(Job.id == self.job_id, Job.worker == self.worker, Job.status == "running")
                .values(**values).execution_options(synchronize_session=False))
            if result.rowcount != 1:  # type: ignore[attr-defined]
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
        self.join(timeout=10)


# ---- running the stages -----------------------------------------------------------------------------

@dataclass
class Loaded:
    model: Any = None
    tokenizer: Any = None


class JobRun:
    def __init__(self, *, db: Database, settings: Settings, job: Job, worker: str, monitor: Monitor) -> None:
        self.db, self.settings, self.worker, self.monitor = db, settings, worker, monitor
        self.job_id = job.id
        self.spec = JobSpec.model_validate(job.spec)
        self.fingerprint = job.fingerprint
        self.done: list[str] = list(job.stages_done or [])
        self.storage = Storage(settings.storage)
        self.work = self.storage.work_dir(job.id)
        self.stage: str | None = None
        self._stage_t0 = 0.0

    # -- bookkeeping --

    def check(self) -> None:
        if self.monitor.lost.is_set():
            raise LeaseLost(f"job {self.job_id}: lease lost to another worker")
        if self.monitor.cancel.is_set():
            raise JobCancelled(f"cancelled during {self.stage}")

    def should_stop(self) -> bool:
        """Between micro-batches: the (test-only) stage delay, then the flags the monitor read."""
        if self.settings.stage_delay_s:
            time.sleep(self.settings.stage_delay_s)
        if self.monitor.lost.is_set():
            raise LeaseLost(f"job {self.job_id}: lease lost to another worker")
        return self.monitor.cancel.is_set()

    def progress(self, _name: str, fraction: float) -> None:
        self.monitor.report(fraction)
        if self.monitor.cancel.is_set() and self.stage == "exporting":
            raise JobCancelled("cancelled during exporting")

    def _owned(self, session: Session) -> Job:
        job = session.get(Job, self.job_id, with_for_update=True, populate_existing=True)
        if job is None or job.worker != self.worker or job.status != "running":
            raise LeaseLost(f"job {self.job_id}: no longer leased by {self.worker}")
        return job

    def enter(self, stage: str, **note: Any) -> None:
        self.check()
        self.stage, self._stage_t0 = stage, time.perf_counter()
        self.monitor.start_stage()
        with self.db.transaction() as session:
            job = self._owned(session)
            job.stage, job.progress, job.eta_s, job.stage_started_at = stage, 0.0, None, utcnow()
            job.history = [*(job.history or []), event("stage-start", stage=stage, attempt=job.attempts, **note)]
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
            job.history = [*(job.history or []), event("stage-done", stage=stage, seconds=round(seconds, 3), **note)]
        if stage not in self.done:
            self.done.append(stage)

    def _artifact_rows(self, session: Session, files: list[tuple[str, str, Path]]) -> None:
        """Install files as artifacts (skipping names already recorded) and add their rows."""
        have = set(session.scalars(select(Artifact.name).where(Artifact.job_id == self.job_id)).all())
        for name, kind, path in files:
            if name in have:
                continue
            key = Storage.artifact_key(self.job_id, name)
            dest = self.storage.install(path, key)
            session.add(Artifact(job_id=self.job_id, name=name, kind=kind, size=dest.stat().st_size,
                                 sha256=sha256_file(dest), storage_key=key))

    def write_metrics(self, rows: list[dict[str, Any]]) -> None:
        """Evaluation rows (layout, seed, step, kl, ppl, loss, lr) into the metrics table, if this
        worker still holds the job (the job row's lock also serialises writers)."""
        with self.db.transaction() as session:
            self._owned(session)
            upsert_metrics(session, self.job_id, rows)

    # -- the stages --

    def run(self) -> None:
        from models import pipeline
        from models.affinity import AffinityResult
        from models.calibration import CalibrationSpec
        from models.families import model_shape
        from models.layout import check_delta, check_devices
        from models.loading import ModelSource, load_config, load_model, load_tokenizer

        spec = self.spec
        self.work.mkdir(parents=True, exist_ok=True)
        cache_key = Storage.affinity_key(self.fingerprint)
        cache_path = self.storage.path(cache_key)
        have_affinity = "affinity" in self.done or cache_path.is_file()
        need_export = spec.export.any and "exporting" not in self.done
        need_distill = spec.distill is not None and "distilling" not in self.done
        calibration_shown = CalibrationSpec(**spec.calibration.model_dump())
        calibration = CalibrationSpec(**{**spec.calibration.model_dump(),
                                         "source": resolve_data(self.settings.data_dir, spec.calibration.source)})
        ospec = pipeline.OptimiseSpec(devices=spec.devices, delta=spec.delta, score=spec.score,
                                      random_layouts=spec.random_layouts, ablations=spec.ablations,
                                      export=spec.export.any, batch_size=spec.batch_size, restarts=spec.restarts)
        state = pipeline.RunState(out_dir=self.work)

        # loading: the config is always checked; weights only when a later stage needs them. The device
        # this attempt runs on is recorded with the stage (the job view's `device`).
        self.enter("loading", device=prepare_device(self.settings.device, self.settings.cuda_memory_fraction))
        location = prepare_model(settings=self.settings, spec=spec)  # limits checked; a hub id → its snapshot
        source = ModelSource(**location.loader_args())
        shape = model_shape(load_config(source))
        check_devices(shape, spec.devices)
        check_delta(shape, spec.delta)
        self.monitor.report(0.05)
        loaded = Loaded()
        if not have_affinity or need_export or need_distill:
            loaded.model = load_model(source, dtype=spec.model.dtype, device=self.settings.device)
            self.monitor.report(0.9)
            loaded.tokenizer = load_tokenizer(source)
        self.complete("loading", weights=loaded.model is not None)

        # calibration
        blocks_file = self.work / "blocks.npy"
        if "calibration" not in self.done:
            self.enter("calibration")
            if have_affinity:
                self.complete("calibration", skipped="affinity cached")
            else:
                pipeline.stage_calibration(state, model=loaded.model, tokenizer=loaded.tokenizer,
                                           calibration=calibration)
                _save_npy(blocks_file, state.blocks)
                self.complete("calibration", tokens=int(state.blocks.numel()) if state.blocks is not None else 0)
        elif not have_affinity:
            import numpy as np
            import torch

            state.blocks = torch.from_numpy(np.load(blocks_file))

        # affinity
        if "affinity" not in self.done:
            self.enter("affinity")
            computed_here = self.work / "affinity.computed"  # survives a crash between caching and recording
            cached = cache_path.is_file() and not computed_here.exists()
            if not cache_path.is_file():
                pipeline.stage_affinity(state, model=loaded.model, spec=ospec, model_name=spec.model.id,
                                        calibration=calibration_shown, progress=self.progress,
                                        should_stop=self.should_stop)
                produced = self.work / pipeline.AFFINITY_FILE
                cache_path.parent.mkdir(parents=True, exist_ok=True)
                computed_here.touch()
                if cache_path.is_file():  # another job with the same fingerprint finished first
                    produced.unlink()
                else:
                    produced.replace(cache_path)
            state.affinity = AffinityResult.load(cache_path)

            def record_affinity(session: Session, job: Job) -> None:
                job.affinity_cached = cached
                have = session.scalars(select(Artifact.id).where(Artifact.job_id == self.job_id,
                                                                 Artifact.name == pipeline.AFFINITY_FILE)).first()
                if have is None:
                    session.add(Artifact(job_id=self.job_id, name=pipeline.AFFINITY_FILE, kind="affinity",
                                         size=cache_path.stat().st_size, sha256=sha256_file(cache_path),
                                         storage_key=cache_key))

            self.complete("affinity", record_affinity, cached=cached)
        else:
            state.affinity = AffinityResult.load(cache_path)

        # optimising
        layouts_dir = self.work / "layouts"
        if "optimising" not in self.done:
            self.enter("optimising")
            shutil.rmtree(layouts_dir, ignore_errors=True)
            pipeline.stage_layouts(state, spec=ospec)

            def record_layouts(session: Session, _job: Job) -> None:
                have = set(session.scalars(select(LayoutRow.name).where(LayoutRow.job_id == self.job_id)).all())
                for name, lay in state.layouts.items():
                    if name not in have:
                        session.add(_layout_row(self.job_id, lay))

            self.complete("optimising", record_layouts, layouts=len(state.layouts))
        else:
            from models.layout import load as load_layout

            state.layouts = {p.stem: load_layout(p) for p in sorted(layouts_dir.glob("*.json"))}

        # exporting
        if need_export:
            self.enter("exporting")
            for sub in ("checkpoint", "shards"):
                shutil.rmtree(self.work / sub, ignore_errors=True)
            # The checkpoint is written first, then the shards rank by rank (those report progress).
            offset = 0.5 if spec.export.checkpoint else 0.0
            pipeline.stage_export(state, model=loaded.model, tokenizer=loaded.tokenizer,
                                  progress=lambda name, f: self.progress(name, offset + (1 - offset) * f),
                                  overwrite=True, checkpoint=spec.export.checkpoint, shards=spec.export.shards)
            self.check()
            files = [(f"{sub}/{p.name}", sub, p) for sub in ("checkpoint", "shards")
                     for p in sorted((self.work / sub).glob("*")) if p.is_file()]
            self.complete("exporting", lambda session, _job: self._artifact_rows(session, files),
                          files=len(files))

        # distilling
        if need_distill:
            self.distil(loaded, layouts_dir)

        # the report, and done
        self.check()
        self.stage = None
        report = pipeline.build_report(state, spec=ospec, model_name=spec.model.id, calibration=calibration_shown)
        self._finish(report)

    def distil(self, loaded: Loaded, layouts_dir: Path) -> None:
        """The distilling stage: every (layout, seed) run of the spec's `distill`, resumable."""
        from models import distill as D
        from models.calibration import CalibrationSpec

        spec = self.spec.distill
        assert spec is not None
        out_dir = self.work / "distill"
        shown = dict(zip(("train", "eval"), spec.data_specs(self.spec.calibration), strict=True))
        data = {part: CalibrationSpec(**{**fields, "source": resolve_data(self.settings.data_dir, fields["source"],
                                                                          field=f"distill.{part}.source")})
                for part, fields in shown.items()}
        dspec = D.DistillSpec(layouts=tuple(spec.layouts), train=data["train"], eval=data["eval"],
                              devices=self.spec.devices, delta=self.spec.delta, seeds=tuple(spec.seeds),
                              recipe=D.DistillRecipe.from_dict(spec.recipe_fields()))
        total_steps = len(dspec.layouts) * len(dspec.seeds) * dspec.recipe.steps
        self.enter("distilling")
        t0, trained = time.monotonic(), 0

        def on_step(_layout: str, _seed: int, _stats: Any, _last: Any) -> None:
            nonlocal trained
            trained += 1

        def progress(_stage: str, fraction: float) -> None:
            # Steps trained in this attempt set the pace: a resumed stage starts part-way.
            eta = (time.monotonic() - t0) / trained * total_steps * (1 - fraction) if trained else None
            self.monitor.report(fraction, eta_s=eta)

        def on_eval(record: Any) -> None:
            self.write_metrics([record.as_dict()])

        def on_run_start(_layout: str, _seed: int) -> None:
            # Evaluations read back from earlier attempts (finished runs, checkpoints) are in metrics.csv.
            self.write_metrics(read_metrics_csv(out_dir / "metrics.csv"))

        D.run_distill(dspec, teacher=loaded.model, tokenizer=loaded.tokenizer, out_dir=out_dir,
                      layouts_dir=layouts_dir, model_id=self.spec.model.id, progress=progress,
                      should_stop=self.should_stop, on_eval=on_eval, on_step=on_step, on_run_start=on_run_start,
                      plot=True, keep_checkpoints=False)
        self.check()
        # The data specs as submitted (names, not the server's paths), in the published summary.
        summary_file = out_dir / "summary.json"
        summary = json.loads(summary_file.read_text())
        for part, fields in shown.items():
            summary[part] = {**summary.get(part, {}), **fields}
        _write_json(summary_file, summary)
        staging = self.work / "distill-publish"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        files = []
        for name in DISTILL_FILES:
            shutil.copyfile(out_dir / name, staging / name)  # the work directory keeps its copy
            files.append((f"distill/{name}", "distill", staging / name))

        def record(session: Session, _job: Job) -> None:
            upsert_metrics(session, self.job_id, read_metrics_csv(out_dir / "metrics.csv"))
            self._artifact_rows(session, files)

        # steps_trained < total_steps: this attempt resumed from finished runs or checkpoints.
        self.complete("distilling", record, runs=len(dspec.layouts) * len(dspec.seeds), steps_trained=trained,
                      total_steps=total_steps)
        shutil.rmtree(staging, ignore_errors=True)

    def _finish(self, report: dict[str, Any]) -> None:
        report_file = self.work / "report.json"
        with self.db.transaction() as session:
            job = self._owned(session)
            report["seconds"] = dict(job.timings or {})
            report["job"] = {"id": self.job_id, "fingerprint": self.fingerprint,
                             "affinity_cached": bool(job.affinity_cached)}
            tmp = report_file.with_name(report_file.name + ".tmp")
            tmp.write_text(json.dumps(report, indent=1))
            tmp.replace(report_file)
            self._artifact_rows(session, [("report.json", "report", report_file)])
            job.summary = {key: report.get(key) for key in ("tokens", "random_expectation", "upper_bound",
                                                             "upper_bound_exact", "notes")}
            job.summary["layouts"] = {name: rep["J"] for name, rep in report["layouts"].items()}
            distilled = self.work / "distill" / "summary.json"
            if self.spec.distill is not None and distilled.is_file():
                doc = json.loads(distilled.read_text())
                job.summary["distill"] = {"dense_ppl": doc.get("dense_ppl"), "headline": doc.get("headline"),
                                          "summary": DISTILL_SUMMARY}
            now = utcnow()
            job.status, job.stage, job.progress, job.eta_s = "succeeded", None, 1.0, None
            job.finished_at, job.updated_at, job.lease_until = now, now, None
            job.history = [*(job.history or []), event("succeeded", attempt=job.attempts)]
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


def upsert_metrics(session: Session, job_id: str, rows: list[dict[str, Any]]) -> None:
    """One `metrics` row per (job, layout, seed, step, name): an existing row is updated, a missing one
    inserted; empty and non-finite values (the loss at step 0) are not written."""
    if not rows:
        return
    keyed = [(str(r["layout"]), int(r["seed"]), int(r["step"]), r) for r in rows]
    query = select(Metric).where(Metric.job_id == job_id, Metric.layout.in_({k[0] for k in keyed}),
                                 Metric.seed.in_({k[1] for k in keyed}), Metric.step.in_({k[2] for k in keyed}),
                                 Metric.name.in_(METRIC_NAMES))
    existing = {(m.layout, m.seed, m.step, m.name): m for m in session.scalars(query)}
    for layout, seed, step, row in keyed:
        for name in METRIC_NAMES:
            raw = row.get(name)
            if raw is None or raw == "":
                continue
            value = float(raw)
            if not math.isfinite(value):
                continue
            have = existing.get((layout, seed, step, name))
            if have is None:
                existing[(layout, seed, step, name)] = have = Metric(job_id=job_id, layout=layout, seed=seed,
                                                                     step=step, name=name, value=value)
                session.add(have)
            elif have.value != value:
                have.value = value


def _save_npy(path: Path, blocks: Any) -> None:
    import numpy as np

    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, blocks.numpy())
    tmp.replace(path)


def _layout_row(job_id: str, lay: Any) -> LayoutRow:
    from dataclasses import asdict

    score = lay.score or {}
    return LayoutRow(job_id=job_id, name=lay.name, J=float(score["J"]),
                     random_expectation=float(score["random_expectation"]),
                     upper_bound=float(score["upper_bound"]), upper_bound_exact=bool(score["upper_bound_exact"]),
                     up_fraction=[float(x) for x in score["up_fraction"]],
                     down_fraction=[float(x) for x in score["down_fraction"]],
                     kv_group_device=lay.kv_group_device.tolist(), neuron_device=lay.neuron_device.tolist(),
                     shape=asdict(lay.shape), score=score)


def _end(db: Database, job_id: str, worker: str, *, status: str, error: str | None, stage: str | None) -> bool:
    """Mark the job failed or cancelled, if this worker still holds it."""
    with db.transaction() as session:
        job = session.get(Job, job_id, with_for_update=True, populate_existing=True)
        if job is None or job.worker != worker or job.status != "running":
            return False
        now = utcnow()
        job.status, job.error, job.error_stage = status, error, stage if status == "failed" else None
        job.stage = stage
        job.finished_at, job.updated_at, job.lease_until, job.eta_s = now, now, None, None
        job.history = [*(job.history or []), event(status, stage=stage, attempt=job.attempts)]
    return True


def user_errors() -> tuple[type[BaseException], ...]:
    from models.assets import AssetNotFoundError
    from models.export import ExportError

    return (ValueError, AssetNotFoundError, ExportError, OSError)


def run_job(job_id: str, *, settings: Settings, db: Database, worker: str) -> str:
    """Claim and run the job; returns what happened: skipped, succeeded, failed, cancelled or lost."""
    job = claim(db, job_id, worker=worker, lease_s=settings.lease_s)
    if job is None:
        log.info("job %s: nothing to do (finished, cancelled or leased by a live worker)", job_id)
        return "skipped"
    if job.cancel_requested:
        _end(db, job_id, worker, status="cancelled", error="cancelled by request", stage=job.stage)
        return "cancelled"
    if job.attempts > settings.max_attempts:
        _end(db, job_id, worker, status="failed", stage=job.stage,
             error=f"gave up after {settings.max_attempts} attempts (the worker was lost each time)")
        return "failed"
    monitor = Monitor(db, job_id, worker, settings.lease_s)
    monitor.start()
    runner = JobRun(db=db, settings=settings, job=job, worker=worker, monitor=monitor)
    try:
        runner.run()
        return "succeeded"
    except LeaseLost:
        log.warning("job %s: lease lost; leaving it to the worker that holds it", job_id)
        return "lost"
    except Exception as exc:
        from models.affinity import Cancelled

        if isinstance(exc, JobCancelled | Cancelled):
            _end(db, job_id, worker, status="cancelled", error="cancelled by request", stage=runner.stage)
            return "cancelled"
        if database_unreachable(exc):  # nothing can be recorded: the lease expires, a sweeper retries it
            log.warning("job %s: the database became unreachable during %s; left to be retried when it is back",
                        job_id, runner.stage)
            return "retried"
        if disk_full(exc, settings.storage):
            log.error("job %s: the storage volume is full (%s): %s", job_id, runner.stage, exc)
            if _end(db, job_id, worker, status="failed", error=no_space_message(runner.stage, settings.storage),
                    stage=runner.stage):
                remove_work(Storage(settings.storage).work_dir(job_id))  # once ended by us: no attempt resumes
            return "failed"
        oom = out_of_memory_message(exc, stage=runner.stage)
        if oom is not None:
            message = oom
            log.error("job %s: %s", job_id, oom)
        elif isinstance(exc, user_errors()):
            message = str(exc)
        else:
            message = f"{type(exc).__name__}: {exc}"
            log.error("job %s failed in %s:\n%s", job_id, runner.stage, traceback.format_exc())
        _end(db, job_id, worker, status="failed", error=message, stage=runner.stage)
        return "failed"
    finally:
        monitor.stop()
        del runner
        _release_memory()


def _release_memory() -> None:
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass
