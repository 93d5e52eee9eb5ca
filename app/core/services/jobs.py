"""What the routes do, as functions with keyword-only arguments (the routes stay thin).

Every read and write is scoped to the caller (`app.api.auth.Caller`): a tenant sees only its own jobs,
and another tenant's job is "no such job" (404, existence is not disclosed); an admin, or anyone
when the API is open, sees all. Torch-free: the API process imports this module.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Collection, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Select, delete, func, select, text
from sqlalchemy.orm import Session

from app.core import events, hub, logs
from app.core.caller import Caller
from app.core.db import (
    FINISHED,
    STATUSES,
    Artifact,
    Database,
    Job,
    JobEvent,
    LayoutRow,
    Metric,
    new_id,
    utcnow,
    write_transaction,
)
from app.core.errors import BrokerUnavailable, Conflict, NotFound, SpecError, redact_paths
from app.core.jobstate import DISTILL_SUMMARY
from app.core.safe_text import for_log
from app.core.schemas.jobs import METRIC_NAMES, JobSpec
from app.core.services import budgets, derived, usage
from app.core.services.artifact_estimate import expected_artifact_bytes
from app.core.services.model_limits import check_model_config
from app.core.services.sources import (
    SourceError,
    affinity_schedule,
    fingerprint,
    read_config,
    resolve_data,
    resolve_model,
    submit_corpora,
)
from app.core.services.timeline import stage_timeline
from app.core.services.uploads import resolve_ref
from app.core.settings import Settings
from app.core.storage.root import DamagedFile, Storage
from models.base.layout_format import LAYOUT_FORMAT
from models.data.source import is_upload, parse_data_source
from models.run.rules import schedule_and_delta, spec_refusals
from models.schedules.grammar import ScheduleError, dtp_spec, dtp_text

log = logging.getLogger(__name__)
JOB_ID = re.compile(r"[0-9a-f]{32}")
_STORED_NAME = re.compile(r"[^\x00-\x1f\x7f]{1,255}")  # what a layout or artifact name can be

__all__ = ["BrokerUnavailable", "Conflict", "NotFound", "SpecError"]  # re-exported: the old import path


def _aware(dt: datetime | None) -> datetime | None:
    return None if dt is None else dt.replace(tzinfo=UTC)


# ---- submit ---------------------------------------------------------------------------------------

UploadLookup = Callable[[str, str, str], Any]  # (ref, kind, field) → the upload row; raises SourceError


def check_spec(*, settings: Settings, spec: JobSpec, tenant: str | None = None,
               uploads: UploadLookup | None = None) -> tuple[str, dict[str, Any]]:
    """The budgets, the model and the calibration source (resolved under their roots, allowed hub ids, or
    the tenant's complete uploads through `uploads`), and the model's config when it can be read without
    downloading weights (`tenant`: whose cached reads may be reused). Returns the fingerprint and what was
    found; raises SpecError naming every bad field."""
    problems = budgets.job_problems(spec, settings)
    # what the run would refuse whatever the model (models.run.rules: the plan of its worker refuses the same)
    problems += [(r.field, r.message) for r in spec_refusals(spec)]
    location = None
    model_path: Path | None = None
    data_path: Path | None = None
    config: dict[str, Any] | None = None
    gguf = spec.model.gguf_file is not None or spec.model.id.endswith(".gguf")  # loaded through a converted copy
    if is_upload(spec.model.id):
        try:
            upload = _upload(uploads, spec.model.id, "model", "model.id")
            config = dict(upload.config or {}) or None
            gguf = any(f.path.endswith(".gguf") for f in upload.files)
            for field, value in (("model.revision", spec.model.revision), ("model.gguf_file", spec.model.gguf_file)):
                if value is not None:
                    problems.append((field, f"{field.split('.')[1]} does not apply to an upload (it is one model)"))
        except SourceError as exc:
            problems.append((exc.field, str(exc)))
    else:
        try:
            location = resolve_model(settings.models_dir, spec.model.id, revision=spec.model.revision,
                                     gguf_file=spec.model.gguf_file)
            if location.is_local and spec.model.revision is not None:
                problems.append(("model.revision", "revision applies to hub models only; this model is a name under "
                                                   "the server's model root"))
            if location.hub_id is not None and (refusal := hub.model_problem(settings, location.hub_id)):
                problems.append(("model.id", refusal))
                location = None
            model_path = location.path if location is not None else None
        except SourceError as exc:
            problems.append((exc.field, str(exc)))
    problems += _data_problems(settings, spec.calibration.source, "calibration.source", uploads)
    if not problems and parse_data_source(spec.calibration.source).kind == "path":
        data_path = Path(resolve_data(settings.data_dir, spec.calibration.source))
    if location is not None:
        config = read_config(location, scope=tenant)
    if config is not None:
        problems += check_model_config(config, spec=spec, settings=settings)
    problems += distill_problems(settings=settings, spec=spec, uploads=uploads)
    if problems:
        raise SpecError(problems)
    fp = fingerprint(model_id=spec.model.id, revision=spec.model.revision, gguf_file=spec.model.gguf_file,
                     dtype=spec.model.dtype, calibration=spec.calibration.model_dump(), model_path=model_path,
                     data_path=data_path, schedule=affinity_schedule(spec.effective_schedule(), spec.devices))
    return fp, {"config_checked": config is not None, "config": config, "gguf": gguf}


def source_problems(*, settings: Settings, body: dict[str, Any], uploads: UploadLookup | None = None,
                    reported: Collection[str] = ()) -> list[tuple[str, str]]:
    """(field, message) for the model and data sources of a submitted body that failed validation: what
    `check_spec` would also refuse, so that one 422 names every problem (an unknown model is not hidden
    behind a missing field). Only the sources sent as strings are resolved, none of the fields already
    `reported` (by the validation) and nothing that needs a valid spec (the model's config against the
    devices: that comes once the spec validates)."""
    problems: list[tuple[str, str]] = []

    def text(parent: Any, key: str) -> str | None:
        value = parent.get(key) if isinstance(parent, dict) else None
        return value if isinstance(value, str) else None

    model = body.get("model")
    model_id = text(model, "id")
    if model_id is not None and not {"model", "model.id"} & set(reported):
        try:
            if is_upload(model_id):
                _upload(uploads, model_id, "model", "model.id")
            else:
                location = resolve_model(settings.models_dir, model_id, revision=text(model, "revision"),
                                         gguf_file=text(model, "gguf_file"))
                if location.hub_id is not None and (refusal := hub.model_problem(settings, location.hub_id)):
                    problems.append(("model.id", refusal))
        except SourceError as exc:
            problems.append((exc.field, str(exc)))
    sources = [("calibration.source", text(body.get("calibration"), "source"))]
    distill = body.get("distill")
    if isinstance(distill, dict):
        sources += [(f"distill.{part}.source", text(distill.get(part), "source")) for part in ("train", "eval")]
    for field, source in sources:
        if source is not None and field not in reported and field.rsplit(".", 1)[0] not in reported:
            problems += _data_problems(settings, source, field, uploads)
    return [(field, message) for field, message in problems if field not in reported]


def _upload(uploads: UploadLookup | None, ref: str, kind: str, field: str) -> Any:
    if uploads is None:
        raise SourceError(field, f"{ref[:100]!r}: uploads are named in jobs submitted to the service")
    return uploads(ref, kind, field)


def _data_problems(settings: Settings, source: str, field: str,
                   uploads: UploadLookup | None = None) -> list[tuple[str, str]]:
    try:
        if is_upload(source):
            _upload(uploads, source, "data", field)
            return []
        resolve_data(settings.data_dir, source, field=field, corpora=submit_corpora(settings.corpora))
    except SourceError as exc:
        return [(exc.field, str(exc))]
    refusal = hub.dataset_problem(settings, source)
    return [(field, refusal)] if refusal else []


def distill_problems(*, settings: Settings, spec: JobSpec,
                     uploads: UploadLookup | None = None) -> list[tuple[str, str]]:
    """(field, message) for the data sources of a `distill` spec outside the rules (its layouts and training
    blocks: models.run.rules.spec_refusals)."""
    distill = spec.distill
    if distill is None:
        return []
    problems: list[tuple[str, str]] = []
    for part in ("train", "eval"):
        data = getattr(distill, part)
        if data is not None:
            problems += _data_problems(settings, data.source, f"distill.{part}.source", uploads)
    return problems


def submit_job(*, session: Session, settings: Settings, spec: JobSpec, caller: Caller,
               enqueue: Callable[[str], None], request_id: str | None = None) -> Job:
    """Check the spec (422), the tenant's capacity (429) and quota with the job's expected artifacts reserved
    (429 `storage_quota`: app.core.services.artifact_estimate), record the job and enqueue it (503 when the
    broker cannot take it within a few seconds: the job is then withdrawn, as if never submitted). The
    request's id goes into the job's `submitted` event."""
    def uploads(ref: str, kind: str, field: str) -> Any:
        return resolve_ref(session, ref, tenant=caller.tenant, kind=kind, field=field)

    fp, found = check_spec(settings=settings, spec=spec, tenant=caller.tenant, uploads=uploads)
    session.rollback()  # the uploads' reads: end that transaction before the write one
    with write_transaction(session):
        budgets.check_capacity(session, tenant=caller.tenant, spec=spec, settings=settings)
        reserved = expected_artifact_bytes(spec, found["config"], converts=found["gguf"])
        usage.check_quota(session, settings=settings, tenant=caller.tenant, asked=reserved,
                          what=f"a job (its artifacts, expected {reserved} bytes)", field="quota")
        job = Job(id=new_id(), spec=spec.model_dump(mode="json"), fingerprint=fp, model_id=spec.model.id,
                  reserved_bytes=reserved, revision=spec.model.revision, devices=spec.devices,
                  schedule=spec.effective_schedule(),
                  score=spec.score,
                  status="queued", owner=caller.tenant, progress=0.0, stages_done=[], timings={},
                  cancel_requested=False, affinity_cached=False, attempts=0)
        session.add(job)
        session.flush()  # the job's row before its first event's (the foreign key)
        events.record(session, job.id, events.SUBMITTED, request_id=request_id,
                      config_checked=found["config_checked"], key=caller.key_name)
    logs.update(job_id=job.id)
    try:
        enqueue(job.id)
    except Exception as exc:
        log.error("could not enqueue job %s (%s: %s); the job is withdrawn", job.id, type(exc).__name__, exc)
        _withdraw(session, job.id)
        raise BrokerUnavailable("the job broker is unreachable; the job was not accepted (nothing was recorded): "
                                "submit it again after Retry-After seconds", headers={"Retry-After": "5"}) from exc
    return job


def _withdraw(session: Session, job_id: str) -> None:
    """Delete a job whose message never reached the broker: the caller is told 503 and submits again, so
    the row must not run later as a second copy. Should the database fail too, the row stays `queued`
    and the queued-job sweeper sends it once the broker is back (the job then runs once)."""
    try:
        session.rollback()
        with write_transaction(session):
            session.execute(delete(Job).where(Job.id == job_id, Job.status == "queued"))
    except Exception:
        log.exception("job %s: could not withdraw it; it stays queued for the sweeper", job_id)


# ---- reading ---------------------------------------------------------------------------------------

def visible(query: Select[Any], caller: Caller) -> Select[Any]:
    """Only the caller's tenant's jobs, unless the caller sees all."""
    return query if caller.admin else query.where(Job.owner == caller.tenant)


def get_job(*, session: Session, job_id: str, caller: Caller, lock: bool = False) -> Job:
    """The job, if the caller may see it; otherwise NotFound, whether or not it exists."""
    job = None
    if JOB_ID.fullmatch(job_id):
        query = visible(select(Job).where(Job.id == job_id), caller)
        job = session.scalars(query.with_for_update() if lock else query).first()
    if job is None:
        raise NotFound(f"no job {job_id[:64]!r}", field="job_id")
    return job


def schedule_filter(schedule: str | None, delta: int | None) -> str | None:
    """The canonical schedule the `schedule` and `delta` filters ask for (`schedule` already canonical):
    `delta=δ` is the shorthand for `schedule=dtp:δ`, as in a job spec; given both, they must agree (422)."""
    if delta is None:
        return schedule
    try:
        parsed, _ = schedule_and_delta(schedule, delta)
    except ScheduleError as exc:  # DeltaConflict: dtp:2 and delta=1
        raise SpecError([("delta", str(exc))]) from exc
    if parsed is None:
        return str(dtp_spec(delta))
    if parsed.kind != "dtp":
        raise SpecError([("delta", f"delta={delta} asks for the {dtp_text(delta)} jobs, but schedule={parsed} has "
                                   f"no δ: give one of them")])
    return str(parsed)


def list_jobs(*, session: Session, caller: Caller, model: str | None = None, status: str | None = None,
              devices: int | None = None, delta: int | None = None, schedule: str | None = None,
              owner: str | None = None, limit: int = 50, offset: int = 0) -> tuple[list[Job], int]:
    """The caller's jobs matching the filters, newest first, and how many match (`schedule` canonical)."""
    query = visible(select(Job), caller)
    for column, value in ((Job.model_id, model), (Job.status, status), (Job.devices, devices),
                          (Job.schedule, schedule_filter(schedule, delta)), (Job.owner, owner)):
        if value is not None:
            query = query.where(column == value)
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = session.scalars(query.order_by(Job.created_at.desc(), Job.id).limit(limit).offset(offset)).all()
    return list(rows), int(total)


def public_roots(settings: Settings) -> dict[str, str]:
    """The server directories job errors must not show, by the name users see instead."""
    import os

    roots = {"MODEL_ROOT": str(settings.models_dir), "DATA_ROOT": str(settings.data_dir),
             "STORAGE_ROOT": str(settings.storage), "VAR_DIR": str(settings.var_dir)}
    hf_home = os.environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")
    roots["HF_CACHE"] = hf_home
    return roots


def printable_error(error: str | None) -> str | None:
    """A job's error as data: text a tenant's file put there (a safetensors dtype, issue 41) may hold
    terminal escapes and line breaks; every non-printable character is shown as an escape (`\\x1b`, `\\n`).
    Errors are stored so by the worker; this covers rows stored before."""
    return None if error is None else for_log(error)


def job_view(job: Job, *, history: Sequence[JobEvent], base: str = "",
             roots: dict[str, str] | None = None) -> dict[str, Any]:
    """What GET /v1/jobs/{id} answers; `history`: the job's events, oldest first (`events.job_events`,
    or `events.events_by_job` for a page of jobs)."""
    url = f"{base}/v1/jobs/{job.id}"
    return {
        "id": job.id, "status": job.status, "stage": job.stage, "progress": round(job.progress or 0.0, 4),
        "eta_s": None if job.eta_s is None else round(job.eta_s, 1), "stages_done": list(job.stages_done or []),
        "affinity_cached": bool(job.affinity_cached), "cancel_requested": bool(job.cancel_requested),
        "attempts": job.attempts, "owner": job.owner,
        "spec": job.spec, "schedule": job.schedule, "fingerprint": job.fingerprint,
        "error": printable_error(redact_paths(job.error, roots or {})),
        "error_stage": job.error_stage,
        "created_at": _aware(job.created_at), "started_at": _aware(job.started_at),
        "finished_at": _aware(job.finished_at), "updated_at": _aware(job.updated_at),
        "timings": dict(job.timings or {}), "summary": job.summary,
        "expired_at": _aware(job.expired_at), "expired_reason": job.expired_reason, "device": events.device(history),
        "timeline": stage_timeline(history, status=job.status, created_at=job.created_at),
        "links": {"self": url, "layouts": f"{url}/layouts", "artifacts": f"{url}/artifacts",
                  "metrics": f"{url}/metrics", "cancel": f"{url}/cancel"},
    }


def cancel_job(*, session: Session, job_id: str, caller: Caller, request_id: str | None = None) -> Job:
    """Queued jobs are cancelled at once; running ones stop between micro-batches (the worker sees the flag)."""
    with write_transaction(session):
        job = get_job(session=session, job_id=job_id, caller=caller, lock=True)
        if job.status in FINISHED:
            raise Conflict(f"job {job_id!r} is already {job.status}; only queued or running jobs can be cancelled")
        now = utcnow()
        if job.status == "queued":
            job.status, job.finished_at, job.error = "cancelled", now, "cancelled before it started"
        job.cancel_requested = True
        job.updated_at = now
        events.record(session, job.id, events.CANCEL_REQUESTED, request_id=request_id, by=caller.key_name)
    return job


def delete_job(*, session: Session, storage: Storage, job_id: str, caller: Caller) -> Job:
    """A finished job's artifacts removed from the store; the row stays, marked `deleted`. 409 for a
    queued or running job (cancel it first)."""
    with write_transaction(session):
        job = get_job(session=session, job_id=job_id, caller=caller, lock=True)
        if job.status not in FINISHED:
            raise Conflict(f"job {job_id!r} is {job.status}; only a finished job can be deleted (cancel it first: "
                           f"POST /v1/jobs/{job_id}/cancel)")
        if job.expired_at is None:
            job.expired_at, job.expired_reason, job.updated_at = utcnow(), "deleted", utcnow()
    # After the commit: a download that raced the delete sees the mark (410) or a file still there.
    usage.remove_job_files(storage, job_id)
    derived.release(session, storage.objects, derived.job_needer(job_id))  # its affinity entry, converted copies
    return job


def list_layouts(*, session: Session, job_id: str, caller: Caller) -> list[LayoutRow]:
    get_job(session=session, job_id=job_id, caller=caller)
    rows = session.scalars(select(LayoutRow).where(LayoutRow.job_id == job_id)).all()
    return sorted(rows, key=lambda r: (-r.J, r.name))


def layout_document(*, session: Session, job_id: str, name: str, caller: Caller) -> dict[str, Any]:
    """The `dtp-layout/1` JSON of one of the job's layouts."""
    job = get_job(session=session, job_id=job_id, caller=caller)
    row = None
    if len(name) <= 64 and _STORED_NAME.fullmatch(name):
        row = session.scalars(select(LayoutRow).where(LayoutRow.job_id == job_id, LayoutRow.name == name)).first()
    if row is None:
        raise NotFound(f"job {job_id!r} has no layout {name[:64]!r}", field="name")
    doc: dict[str, Any] = {"format": LAYOUT_FORMAT, "name": row.name, "devices": job.devices, "delta": job.delta,
                           "model": row.shape, "kv_group_device": row.kv_group_device,
                           "neuron_device": row.neuron_device}
    if row.score is not None:
        doc["score"] = row.score
    return doc


def list_artifacts(*, session: Session, job_id: str, caller: Caller, base: str = "") -> dict[str, Any]:
    """What GET /v1/jobs/{id}/artifacts answers: the job's files with their download links; once they were
    removed from the store (DELETE, retention), no items (each download would be 410) and when, why and
    how many were removed. 200 either way: the job is there, its list of files is empty."""
    job = get_job(session=session, job_id=job_id, caller=caller)
    rows = session.scalars(select(Artifact).where(Artifact.job_id == job_id).order_by(Artifact.name)).all()
    url = f"{base}/v1/jobs/{job_id}/artifacts"
    removed = job.expired_at is not None
    items = [] if removed else [{"name": a.name, "kind": a.kind, "size": a.size, "sha256": a.sha256,
                                 "link": f"{url}/{a.name}"} for a in rows]
    return {"items": items, "expired_at": _aware(job.expired_at), "expired_reason": job.expired_reason,
            "removed": len(rows) if removed else 0}


def get_artifact(*, session: Session, job_id: str, name: str, caller: Caller) -> Artifact:
    """Looked up by (job, name) in the database: the name never becomes a path."""
    get_job(session=session, job_id=job_id, caller=caller)
    row = None
    if _STORED_NAME.fullmatch(name):
        row = session.scalars(select(Artifact).where(Artifact.job_id == job_id, Artifact.name == name)).first()
    if row is None:
        raise NotFound(f"job {job_id!r} has no artifact {name[:255]!r}", field="name")
    return row


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def job_metrics(*, session: Session, storage: Storage, job_id: str, caller: Caller, layout: str | None = None,
                seed: int | None = None, name: str | None = None) -> dict[str, Any]:
    """The distillation curves of a job from the `metrics` table, one per (layout, seed), and the
    headline of summary.json once the distilling stage published it."""
    job = get_job(session=session, job_id=job_id, caller=caller)
    names = [name] if name is not None else list(METRIC_NAMES)
    query = select(Metric).where(Metric.job_id == job_id, Metric.name.in_(names))
    if layout is not None:
        query = query.where(Metric.layout == layout)
    if seed is not None:
        query = query.where(Metric.seed == seed)
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
        try:  # checked like a download: a damaged summary.json is not shown as the job's headline
            with storage.open_verified(summary_row.storage_key, size=summary_row.size,
                                       sha256=summary_row.sha256) as f:
                doc = json.loads(f.read())
            summary = {"dense_ppl": doc.get("dense_ppl"), "headline": doc.get("headline"),
                       "seconds": doc.get("seconds")}
        except (OSError, ValueError, DamagedFile):
            log.warning("job %s: cannot read %s", job_id, DISTILL_SUMMARY, exc_info=True)
    return {"job_id": job.id, "status": job.status, "stage": job.stage, "curves": curves, "summary": summary}


def latest_scores(*, session: Session, caller: Caller, model: str | None = None, revision: str | None = None,
                  devices: int | None = None, delta: int | None = None, schedule: str | None = None,
                  score: str | None = None, owner: str | None = None) -> dict[str, Any]:
    """J per layout of the caller's latest succeeded job matching the filters (an admin's: anyone's,
    or `owner`'s); `schedule` canonical, `delta` its dtp:δ shorthand (`schedule_filter`)."""
    schedule = schedule_filter(schedule, delta)
    query = visible(select(Job).where(Job.status == "succeeded"), caller)
    for column, value in ((Job.model_id, model), (Job.revision, revision), (Job.devices, devices),
                          (Job.schedule, schedule), (Job.score, score), (Job.owner, owner)):
        if value is not None:
            query = query.where(column == value)
    job = session.scalars(query.order_by(Job.finished_at.desc(), Job.created_at.desc()).limit(1)).first()
    if job is None:
        raise NotFound(f"no finished job matches model={model} revision={revision} devices={devices} "
                       f"schedule={schedule} score={score}" + (f" owner={owner}" if owner else ""), field="model")
    rows = session.scalars(select(LayoutRow).where(LayoutRow.job_id == job.id)).all()
    summary = job.summary or {}
    return {"job_id": job.id, "model": job.model_id, "revision": job.revision, "devices": job.devices,
            "schedule": job.schedule, "delta": job.delta, "score": job.score, "finished_at": _aware(job.finished_at),
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
