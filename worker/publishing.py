"""What a run publishes, apart from running it: each finished stage's files uploaded to the store with the rows
that record them (`Publisher.stage`), report.json and the job's summary once it succeeds (`Publisher.report`),
and the affinity stage's result in the per-tenant cache (`CachedAffinity`).

`worker.run.JobRun` runs the job and holds one `Publisher`, which it gives what publishing needs and nothing
else: the job's identity and work directory, the store, the run's lease (every row is written inside its
fence, `Lease.fence`: a run that lost the job records nothing) and its stop check (between uploads). The run
records each stage (`JobRun.complete`) with the rows its publisher hands back."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core import events
from app.core.db import Artifact, Database, Job, LayoutRow, utcnow
from app.core.jobstate import DISTILL_SUMMARY
from app.core.lease import Lease
from app.core.schemas.jobs import JobSpec
from app.core.settings import Settings
from app.core.storage.root import Storage, sha256_file
from models.run.files import DISTILL_DIR, REPORT_FILE, UndeclaredArtifact, kind_of, published_by
from models.run.stages import AffinityStore
from models.serving.commands import serve_summary
from worker.metrics import read_metrics_csv, upsert_metrics

log = logging.getLogger("dtp_layout.worker")
DISTILL_FILES = tuple(PurePosixPath(a.pattern).name for a in published_by("distilling"))  # under work/distill/

AFFINITY_COPY = "affinity.cached.safetensors"  # the work directory's copy of the cache entry the stages read


class CachedAffinity(AffinityStore):
    """The affinity stage's result in the per-tenant cache (the store's affinity/<tenant>/<fingerprint>/),
    shared by the tenant's jobs with the same fingerprint, never by another tenant's. The stages read a
    copy in the work directory (fetched from the store on a hit); the job's `affinity.safetensors`
    artifact is that copy, published under the job's own key (deleting another job never takes it)."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher
        self.key = Storage.affinity_key(publisher.fingerprint, tenant=publisher.owner)
        self.path = publisher.work / AFFINITY_COPY
        self.computed_here = publisher.work / "affinity.computed"  # survives a crash between caching and recording

    def lookup(self) -> bool | None:
        storage = self.publisher.storage
        if not self.path.is_file():
            if storage.objects.head(self.key) is None:
                return None
            storage.objects.fetch(self.key, self.path)
        return not self.computed_here.exists()

    def publish(self, produced: Path) -> None:
        publisher = self.publisher
        self.computed_here.touch()
        produced.replace(self.path)
        with publisher.db.transaction() as session:
            publisher.lease.fence(session)  # a run that lost the job leaves the cache alone
        if publisher.storage.objects.head(self.key) is None:  # else another job with the fingerprint won
            publisher.reserve([self.path])  # the tenant's cache entry counts against its quota too
            publisher.storage.publish(self.path, self.key, sha256=sha256_file(self.path))


Rows = Callable[[Session, Job], None]  # what a stage's record writes inside its transaction (under the fence)


@dataclass
class StageRecord:
    """What publishing a finished stage hands back to the run, which records the stage with it in one
    transaction: the rows to write (artifacts, layouts, metrics) and what the stage's event notes."""

    rows: Rows | None = None
    note: dict[str, Any] = field(default_factory=dict)


class Publisher:
    """The uploads and rows of one attempt at a job (`worker.run.JobRun` holds one): each finished stage's
    files (`stage`), the report and the job's summary (`report`), and the store's quota reservation."""

    def __init__(self, *, db: Database, settings: Settings, storage: Storage, spec: JobSpec, lease: Lease,
                 owner: str | None, fingerprint: str, work: Path, check: Callable[[], None]) -> None:
        self.db, self.settings, self.storage, self.spec, self.lease = db, settings, storage, spec, lease
        self.job_id, self.attempt = lease.job_id, lease.attempt
        self.owner, self.fingerprint, self.work = owner, fingerprint, work
        self.check = check  # the run's: raises why it must end (between uploads)

    def upload(self, files: list[tuple[str, str, Path]]) -> list[tuple[str, str, str, int, str]]:
        """(name, kind, key, size, sha256) of files about to be published: hashed and put in the store
        before the transaction that records their rows (the job row is not held locked while hashing or
        uploading, and a row is never visible before its object is whole). Each goes to this attempt's
        key (Storage.artifact_key): a run that lost the job can upload, but never over the winner's
        objects, and never records a row; what no row lists is swept."""
        with self.db.session() as session:
            have = set(session.scalars(select(Artifact.name).where(Artifact.job_id == self.job_id)).all())
        self.reserve([path for name, _kind, path in files if name not in have])
        out = []
        for name, kind, path in files:
            if kind != kind_of(name):  # every file published is declared (models/run/files.py ARTIFACTS)
                raise UndeclaredArtifact(f"artifact {name!r} is declared as {kind_of(name)!r}, not {kind!r}")
            if name in have:
                continue
            self.check()
            size, digest = path.stat().st_size, sha256_file(path)
            key = Storage.artifact_key(self.job_id, name, self.attempt)
            self.storage.publish(path, key, sha256=digest)
            out.append((name, kind, key, size, digest))
        return out

    def reserve(self, paths: list[Path]) -> None:
        """The job's quota reservation raised to cover `paths` before they reach the store: past the
        tenant's quota the job fails naming it, and nothing of them is published (app.core.services.usage)."""
        from app.core.errors import ApiError
        from app.core.services.usage import reserve_more

        try:
            reserve_more(self.db, settings=self.settings, job_id=self.job_id, tenant=self.owner,
                         publishing=sum(p.stat().st_size for p in paths))
        except ApiError as exc:
            raise ValueError(exc.detail) from None

    def _artifact_rows(self, session: Session, files: list[tuple[str, str, str, int, str]]) -> None:
        """Add the rows of uploaded files (skipping names already recorded); called inside the stage's
        transaction, after the fence: a run that lost the job records nothing."""
        have = set(session.scalars(select(Artifact.name).where(Artifact.job_id == self.job_id)).all())
        for name, kind, key, size, digest in files:
            if name in have:
                continue
            session.add(Artifact(job_id=self.job_id, name=name, kind=kind, size=size, sha256=digest,
                                 storage_key=key))

    def stage(self, name: str, note: dict[str, Any]) -> StageRecord:
        """Publish what the finished stage `name` produced (its files uploaded; its note from the stages):
        the rows and note the run records the stage with."""
        record = {"affinity": self._record_affinity, "optimising": self._record_layouts,
                  "stability": self._record_stability, "exporting": self._record_export,
                  "distilling": self._record_distill}.get(name)
        return StageRecord() if record is None else record(note)

    def _record_affinity(self, note: dict[str, Any]) -> StageRecord:
        from models.run.files import AFFINITY_FILE
        from worker.derived_data import record_affinity

        published = self.upload([(AFFINITY_FILE, kind_of(AFFINITY_FILE), self.work / AFFINITY_COPY)])
        record_affinity(self.db, self.storage, owner=self.owner, fingerprint=self.fingerprint, job_id=self.job_id)

        def record(session: Session, job: Job) -> None:
            job.affinity_cached = note["cached"]
            self._artifact_rows(session, published)

        return StageRecord(record)

    def _record_layouts(self, note: dict[str, Any]) -> StageRecord:
        from models.layouts.layout import load

        layouts = [load(p) for p in sorted((self.work / "layouts").glob("*.json"))]

        def record(session: Session, _job: Job) -> None:
            have = set(session.scalars(select(LayoutRow.name).where(LayoutRow.job_id == self.job_id)).all())
            for lay in layouts:
                if lay.name not in have:
                    session.add(_layout_row(self.job_id, lay))

        return StageRecord(record)

    def _record_stability(self, note: dict[str, Any]) -> StageRecord:
        from models.run.files import STABILITY_FILE

        # Published once the job succeeds, inside report.json (and the job's summary).
        assert (self.work / STABILITY_FILE).is_file()
        return StageRecord()

    def _record_export(self, note: dict[str, Any]) -> StageRecord:
        from models.run.files import EXPORT_DIRS

        files = [(f"{sub}/{p.name}", kind_of(f"{sub}/{p.name}"), p) for sub in EXPORT_DIRS
                 for p in sorted((self.work / sub).glob("*")) if p.is_file()]
        published = self.upload(files)
        return StageRecord(lambda session, _job: self._artifact_rows(session, published), {"files": len(files)})

    def _record_distill(self, note: dict[str, Any]) -> StageRecord:
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
            files.append((f"{DISTILL_DIR}/{name}", kind_of(f"{DISTILL_DIR}/{name}"), staging / name))

        published = self.upload(files)
        shutil.rmtree(staging, ignore_errors=True)  # uploaded; a rerun of the stage copies them again

        def record(session: Session, _job: Job) -> None:
            upsert_metrics(session, self.job_id, read_metrics_csv(out_dir / "metrics.csv"))
            self._artifact_rows(session, published)

        return StageRecord(record)

    def report(self, report: dict[str, Any]) -> None:
        """report.json published and the job recorded as succeeded with its summary, in one transaction
        under the fence (the last thing a run does)."""
        report_file = self.work / "report.json"
        with self.db.session() as session:
            job = session.get(Job, self.job_id)
            assert job is not None
            report["seconds"] = dict(job.timings or {})
            report["job"] = {"id": self.job_id, "fingerprint": self.fingerprint,
                             "affinity_cached": bool(job.affinity_cached)}
        _write_json(report_file, report)
        published = self.upload([(REPORT_FILE, kind_of(REPORT_FILE), report_file)])
        with self.db.transaction() as session:
            job = self.lease.fence(session)
            self._artifact_rows(session, published)
            job.summary = report_summary(report)
            if "stability" in report:
                job.summary["stability"] = report["stability"]
            distilled = self.work / "distill" / "summary.json"
            if self.spec.distill is not None and distilled.is_file():
                doc = json.loads(distilled.read_text())
                job.summary["distill"] = {"dense_ppl": doc.get("dense_ppl"), "headline": doc.get("headline"),
                                          "world_size": doc.get("world_size", 1), "summary": DISTILL_SUMMARY}
            # how to serve the shards with vLLM (the dashboard's job page and `client status` show it)
            job.summary["serve"] = serve_summary(self.job_id, exported_shards=self.spec.export.shards,
                                                 shards_dir=self.work / "shards")
            now = utcnow()
            job.status, job.stage, job.progress, job.eta_s = "succeeded", None, 1.0, None
            job.finished_at, job.updated_at, job.lease_until = now, now, None
            events.record(session, self.job_id, "succeeded", attempt=job.attempts)
        log.info("job %s: succeeded", self.job_id)


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


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


def report_summary(report: dict[str, Any]) -> dict[str, Any]:
    """The job's summary from its report.json: the figures a listing shows without fetching the report."""
    summary = {key: report.get(key) for key in ("tokens", "random_expectation", "upper_bound", "upper_bound_exact",
                                                "notes")}
    if report.get("kept_mass") is not None:  # the sparse neuron→neuron edges' kept mass (issue 29)
        summary["kept_mass"] = {k: report["kept_mass"][k] for k in ("min", "median", "max")}
    summary["layouts"] = {name: rep["J"] for name, rep in report["layouts"].items()}
    return summary
