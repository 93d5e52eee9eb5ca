"""What the routes do, as functions with keyword-only arguments (the routes stay thin).

Torch-free: the API process imports this module.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, text

from app.db import FINISHED, STATUSES, Artifact, Database, Job, LayoutRow, Metric, utcnow
from app.schemas import METRIC_NAMES, JobSpec
from app.settings import Settings
from app.sources import SourceError, check_config, fingerprint, read_config, resolve_data, resolve_model
from app.storage import Storage
from models.layout import LayoutError
from models.layout_names import canonical_layout_name

log = logging.getLogger(__name__)
LAYOUT_FORMAT = "dtp-layout/1"
DISTILL_SUMMARY = "distill/summary.json"  # the artifact GET /v1/jobs/{id}/metrics reads the headline from


class NotFound(LookupError):
    pass


class Conflict(RuntimeError):
    pass


class Forbidden(PermissionError):
    pass


class SpecError(ValueError):
    """Submit-time problems with a valid-looking spec: (field, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{f}: {m}" for f, m in problems))
        self.problems = problems


class BrokerUnavailable(RuntimeError):
    pass


def _aware(dt: datetime | None) -> datetime | None:
    return None if dt is None else dt.replace(tzinfo=UTC)


def event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"at": utcnow().isoformat() + "Z", "event": kind, **fields}


# ---- submit ---------------------------------------------------------------------------------------

def check_spec(*, settings: Settings, spec: JobSpec) -> tuple[str, dict[str, Any]]:
    """Resolve the model and the calibration source and check the model's config when it can be read
    without downloading weights. Returns the fingerprint and what was found; raises SpecError."""
    problems: list[tuple[str, str]] = []
    location = None
    model_path: Path | None = None
    data_path: Path | None = None
    try:
        location = resolve_model(settings.models_dir, spec.model.id, revision=spec.model.revision,
                                 gguf_file=spec.model.gguf_file)
        if location.is_local and spec.model.revision is not None:
            problems.append(("model.revision", "revision applies to hub models only; this model is a name under "
                                               "the server's model root"))
        model_path = location.path
    except SourceError as exc:
        problems.append((exc.field, str(exc)))
    try:
        resolved = resolve_data(settings.data_dir, spec.calibration.source)
        if not spec.calibration.source.startswith(("corpus:", "hf:")):
            data_path = Path(resolved)
    except SourceError as exc:
        problems.append((exc.field, str(exc)))
    config = read_config(location) if location is not None else None
    if config is not None:
        problems += check_config(config, devices=spec.devices, delta=spec.delta)
    problems += distill_problems(settings=settings, spec=spec)
    if problems:
        raise SpecError(problems)
    fp = fingerprint(model_id=spec.model.id, revision=spec.model.revision, gguf_file=spec.model.gguf_file,
                     dtype=spec.model.dtype, calibration=spec.calibration.model_dump(), model_path=model_path,
                     data_path=data_path)
    return fp, {"config_checked": config is not None}


def distill_problems(*, settings: Settings, spec: JobSpec) -> list[tuple[str, str]]:
    """(field, message) for a `distill` spec the worker would refuse: layouts the job does not produce,
    data sources outside the rules, fewer training blocks than one batch."""
    distill = spec.distill
    if distill is None:
        return []
    problems: list[tuple[str, str]] = []
    produced = spec.layout_names()
    seen: dict[str, str] = {}
    for i, name in enumerate(distill.layouts):
        try:
            canonical = canonical_layout_name(name)  # random:SEED is random-SEED
        except LayoutError as exc:
            problems.append((f"distill.layouts.{i}", str(exc)))
            continue
        if canonical not in produced:
            hint = "" if spec.ablations else "; anti-optimised, heads-only and neurons-only need ablations=true"
            problems.append((f"distill.layouts.{i}", f"layout {name!r} is not one this job produces (it produces: "
                                                     f"{', '.join(produced)}{hint})"))
        elif canonical in seen:
            problems.append((f"distill.layouts.{i}", f"layout {name!r} is {seen[canonical]!r} again"))
        seen.setdefault(canonical, name)
    for part in ("train", "eval"):
        data = getattr(distill, part)
        if data is not None:
            try:
                resolve_data(settings.data_dir, data.source, field=f"distill.{part}.source")
            except SourceError as exc:
                problems.append((exc.field, str(exc)))
    train, _ = distill.data_specs(spec.calibration)
    batch = distill.effective_recipe()["batch_size"]
    if train["sequences"] < batch:
        problems.append(("distill.train.sequences", f"{train['sequences']} training blocks are fewer than one "
                                                    f"batch (recipe.batch_size={batch})"))
    return problems


def submit_job(*, db: Database, settings: Settings, spec: JobSpec, owner: str | None,
               enqueue: Callable[[str], None]) -> Job:
    fp, found = check_spec(settings=settings, spec=spec)
    job = Job(spec=spec.model_dump(mode="json"), fingerprint=fp, model_id=spec.model.id,
              revision=spec.model.revision, devices=spec.devices, delta=spec.delta, score=spec.score,
              status="queued", owner=owner, progress=0.0, stages_done=[], timings={},
              history=[event("submitted", config_checked=found["config_checked"])], cancel_requested=False,
              affinity_cached=False, attempts=0)
    with db.transaction() as session:
        session.add(job)
    try:
        enqueue(job.id)
    except Exception as exc:
        log.exception("could not enqueue job %s", job.id)
        with db.transaction() as session:
            row = session.get(Job, job.id)
            if row is not None:
                row.status, row.error, row.finished_at = "failed", f"could not enqueue the job: {exc}", utcnow()
        raise BrokerUnavailable(f"the job broker is unreachable: {exc}") from exc
    return job


# ---- reading ---------------------------------------------------------------------------------------

def get_job(*, db: Database, job_id: str) -> Job:
    with db.session() as session:
        job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"no job {job_id!r}")
    return job


def list_jobs(*, db: Database, model: str | None = None, status: str | None = None, devices: int | None = None,
              delta: int | None = None, owner: str | None = None, limit: int = 50,
              offset: int = 0) -> tuple[list[Job], int]:
    query = select(Job)
    for column, value in ((Job.model_id, model), (Job.status, status), (Job.devices, devices),
                          (Job.delta, delta), (Job.owner, owner)):
        if value is not None:
            query = query.where(column == value)
    with db.session() as session:
        total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
        rows = session.scalars(query.order_by(Job.created_at.desc(), Job.id).limit(limit).offset(offset)).all()
    return list(rows), int(total)


def job_device(history: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The device the job's latest attempt runs (or ran) on, as its worker recorded it."""
    for entry in reversed(history or []):
        if isinstance(entry.get("device"), dict):
            return dict(entry["device"])
    return None


def job_view(job: Job, *, base: str = "") -> dict[str, Any]:
    url = f"{base}/v1/jobs/{job.id}"
    return {
        "id": job.id, "status": job.status, "stage": job.stage, "progress": round(job.progress or 0.0, 4),
        "eta_s": None if job.eta_s is None else round(job.eta_s, 1), "stages_done": list(job.stages_done or []),
        "affinity_cached": bool(job.affinity_cached), "cancel_requested": bool(job.cancel_requested),
        "attempts": job.attempts, "owner": job.owner,
        "spec": job.spec, "fingerprint": job.fingerprint, "error": job.error, "error_stage": job.error_stage,
        "created_at": _aware(job.created_at), "started_at": _aware(job.started_at),
        "finished_at": _aware(job.finished_at), "updated_at": _aware(job.updated_at),
        "timings": dict(job.timings or {}), "summary": job.summary, "device": job_device(job.history),
        "links": {"self": url, "layouts": f"{url}/layouts", "artifacts": f"{url}/artifacts",
                  "metrics": f"{url}/metrics", "cancel": f"{url}/cancel"},
    }


def cancel_job(*, db: Database, job_id: str, owner: str | None, auth_enabled: bool) -> Job:
    """Queued jobs are cancelled at once; running ones stop between micro-batches (the worker sees the flag)."""
    with db.transaction() as session:
        job = session.get(Job, job_id, with_for_update=True)
        if job is None:
            raise NotFound(f"no job {job_id!r}")
        if auth_enabled and job.owner is not None and job.owner != owner:
            raise Forbidden(f"job {job_id!r} belongs to another owner")
        if job.status in FINISHED:
            raise Conflict(f"job {job_id!r} is already {job.status}; only queued or running jobs can be cancelled")
        now = utcnow()
        if job.status == "queued":
            job.status, job.finished_at, job.error = "cancelled", now, "cancelled before it started"
        job.cancel_requested = True
        job.updated_at = now
        job.history = [*(job.history or []), event("cancel-requested", by=owner)]
    return job


def list_layouts(*, db: Database, job_id: str) -> list[LayoutRow]:
    get_job(db=db, job_id=job_id)
    with db.session() as session:
        rows = session.scalars(select(LayoutRow).where(LayoutRow.job_id == job_id)).all()
    return sorted(rows, key=lambda r: (-r.J, r.name))


def layout_document(*, db: Database, job_id: str, name: str) -> dict[str, Any]:
    """The `dtp-layout/1` JSON of one of the job's layouts."""
    job = get_job(db=db, job_id=job_id)
    with db.session() as session:
        row = session.scalars(select(LayoutRow).where(LayoutRow.job_id == job_id, LayoutRow.name == name)).first()
    if row is None:
        raise NotFound(f"job {job_id!r} has no layout {name!r}")
    doc: dict[str, Any] = {"format": LAYOUT_FORMAT, "name": row.name, "devices": job.devices, "delta": job.delta,
                           "model": row.shape, "kv_group_device": row.kv_group_device,
                           "neuron_device": row.neuron_device}
    if row.score is not None:
        doc["score"] = row.score
    return doc


def list_artifacts(*, db: Database, job_id: str) -> list[Artifact]:
    get_job(db=db, job_id=job_id)
    with db.session() as session:
        return list(session.scalars(select(Artifact).where(Artifact.job_id == job_id).order_by(Artifact.name)).all())


def get_artifact(*, db: Database, job_id: str, name: str) -> Artifact:
    """Looked up by (job, name) in the database: the name never becomes a path."""
    get_job(db=db, job_id=job_id)
    with db.session() as session:
        row = session.scalars(select(Artifact).where(Artifact.job_id == job_id, Artifact.name == name)).first()
    if row is None:
        raise NotFound(f"job {job_id!r} has no artifact {name!r}")
    return row


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def job_metrics(*, db: Database, storage: Storage, job_id: str, layout: str | None = None, seed: int | None = None,
                name: str | None = None) -> dict[str, Any]:
    """The distillation curves of a job from the `metrics` table, one per (layout, seed), and the
    headline of summary.json once the distilling stage published it."""
    job = get_job(db=db, job_id=job_id)
    names = [name] if name is not None else list(METRIC_NAMES)
    query = select(Metric).where(Metric.job_id == job_id, Metric.name.in_(names))
    if layout is not None:
        query = query.where(Metric.layout == layout)
    if seed is not None:
        query = query.where(Metric.seed == seed)
    with db.session() as session:
        rows = session.scalars(query.order_by(Metric.layout, Metric.seed, Metric.step)).all()
        summary_row = session.scalars(select(Artifact).where(Artifact.job_id == job_id,
                                                             Artifact.name == DISTILL_SUMMARY)).first()
    series: dict[tuple[str, int], dict[str, dict[int, float]]] = {}
    for row in rows:
        series.setdefault((row.layout or "", row.seed), {}).setdefault(row.name, {})[row.step] = row.value
    order = {n: i for i, n in enumerate((job.spec.get("distill") or {}).get("layouts") or [])}
    curves = []
    for (lay, sd), values in sorted(series.items(), key=lambda kv: (order.get(kv[0][0], len(order)), kv[0])):
        steps = sorted({step for by_step in values.values() for step in by_step})
        curve: dict[str, Any] = {"layout": lay, "seed": sd, "steps": steps}
        for metric in names:
            by_step = values.get(metric, {})
            curve[metric] = [_finite(by_step.get(step)) for step in steps]
        curves.append(curve)
    summary = None
    if summary_row is not None:
        try:
            doc = json.loads(storage.path(summary_row.storage_key).read_text())
            summary = {"dense_ppl": doc.get("dense_ppl"), "headline": doc.get("headline"),
                       "seconds": doc.get("seconds")}
        except (OSError, ValueError):
            log.warning("job %s: cannot read %s", job_id, DISTILL_SUMMARY, exc_info=True)
    return {"job_id": job.id, "status": job.status, "stage": job.stage, "curves": curves, "summary": summary}


def latest_scores(*, db: Database, model: str | None = None, revision: str | None = None,
                  devices: int | None = None, delta: int | None = None, score: str | None = None) -> dict[str, Any]:
    """J per layout of the latest succeeded job matching the filters."""
    query = select(Job).where(Job.status == "succeeded")
    for column, value in ((Job.model_id, model), (Job.revision, revision), (Job.devices, devices),
                          (Job.delta, delta), (Job.score, score)):
        if value is not None:
            query = query.where(column == value)
    with db.session() as session:
        job = session.scalars(query.order_by(Job.finished_at.desc(), Job.created_at.desc()).limit(1)).first()
        if job is None:
            raise NotFound(f"no finished job matches model={model} revision={revision} devices={devices} "
                           f"delta={delta} score={score}")
        rows = session.scalars(select(LayoutRow).where(LayoutRow.job_id == job.id)).all()
    summary = job.summary or {}
    return {"job_id": job.id, "model": job.model_id, "revision": job.revision, "devices": job.devices,
            "delta": job.delta, "score": job.score, "finished_at": _aware(job.finished_at),
            "tokens": summary.get("tokens"), "random_expectation": summary.get("random_expectation"),
            "upper_bound": summary.get("upper_bound"),
            "layouts": {r.name: r.J for r in sorted(rows, key=lambda r: -r.J)}}


def job_counts(*, db: Database) -> dict[str, int]:
    with db.session() as session:
        rows = session.execute(select(Job.status, func.count()).group_by(Job.status)).all()
    counts = dict.fromkeys(STATUSES, 0)
    counts.update({status: int(n) for status, n in rows})
    return counts


def check_database(*, db: Database) -> None:
    with db.session() as session:
        session.execute(text("SELECT 1"))
