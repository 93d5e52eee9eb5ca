"""The layout service's HTTP API (FastAPI). `create_app()` builds it from the settings.

This process never imports torch: jobs are enqueued by task name and run by the Celery workers.
Run it with `dtp-layout serve` (embedded default) or `uvicorn app.main:create_app --factory`.
"""

from __future__ import annotations

import base64
import logging
import mimetypes
import re
from collections.abc import Iterator
from pathlib import PurePosixPath
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Body, Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app import services
from app.auth import owner as auth_owner
from app.db import Database, database
from app.metrics import Metrics
from app.schemas import (
    EXAMPLE_DISTILL_SPEC,
    EXAMPLE_HUB_SPEC,
    EXAMPLE_SPEC,
    ArtifactList,
    ArtifactOut,
    Health,
    JobList,
    JobOut,
    JobSpec,
    LayoutList,
    LayoutSummary,
    MetricName,
    MetricsOut,
    ScoresOut,
    Status,
)
from app.settings import Settings, get_settings
from app.storage import CHUNK, Storage

log = logging.getLogger(__name__)
Owner = Annotated[str | None, Depends(auth_owner)]

DESCRIPTION = """\
Affinity-aware layouts for Delayed Tensor Parallelism as a service: POST a model and a calibration
spec, a worker runs the affinity pass and the layout optimiser, and the optimised layout, its scores
and the permuted / per-rank sharded checkpoints come back as downloadable artifacts.

A job moves `queued → running → succeeded | failed | cancelled`; while running it reports its stage
(`loading`, `calibration`, `affinity`, `optimising`, `exporting`, and `distilling` when the spec asks
for distillation), the fraction of the stage done and an ETA. The distillation curves come from
`GET /v1/jobs/{id}/metrics` as they are produced.
"""


def _field(loc: Any) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts) or "body"


def _unprocessable(errors: list[dict[str, Any]]) -> JSONResponse:
    message = "; ".join(f"{e['field']}: {e['msg']}" for e in errors)
    return JSONResponse(status_code=422, content={"detail": errors, "message": f"invalid request: {message}"})


def _base(request: Request) -> str:
    public = request.app.state.settings.public_url
    return public.rstrip("/") if public else ""


def _db(request: Request) -> Database:
    db: Database = request.app.state.db
    return db


def _job_out(request: Request, job: Any) -> dict[str, Any]:
    return services.job_view(job, base=_base(request))


def _parse_range(header: str, size: int) -> tuple[int, int] | str | None:
    """(start, end inclusive) of a single `bytes=` range; None to serve it all; 'unsatisfiable'."""
    match = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header)
    if not match or (not match.group(1) and not match.group(2)):
        return None  # malformed or multi-range: ignore, serve the whole file (RFC 9110 allows it)
    first, last = match.group(1), match.group(2)
    if not first:
        suffix = int(last)
        if suffix == 0:
            return "unsatisfiable"
        return max(0, size - suffix), size - 1
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    if start >= size or (last and int(last) < start):
        return "unsatisfiable"
    return start, end


def _iter_file(path: Any, start: int, length: int, metrics: Metrics) -> Iterator[bytes]:
    with open(path, "rb") as f:
        f.seek(start)
        remaining = length
        while remaining > 0:
            block = f.read(min(CHUNK, remaining))
            if not block:
                break
            remaining -= len(block)
            metrics.bytes_served.inc(len(block))
            yield block


def build_router() -> APIRouter:
    v1 = APIRouter(prefix="/v1")

    @v1.post("/jobs", status_code=202, response_model=JobOut, tags=["jobs"],
             summary="Submit a layout job",
             responses={422: {"description": "invalid spec: every bad field is named"},
                        503: {"description": "the broker is unreachable"}})
    def submit(request: Request, owner: Owner, spec: Annotated[JobSpec, Body(openapi_examples={
        "packaged SmolLM2 on the corpus": {"summary": "the model `dtp-layout serve` provides", "value": EXAMPLE_SPEC},
        "hub model, data-root tokens": {"summary": "a hub model and a .npy under the data root",
                                        "value": EXAMPLE_HUB_SPEC},
        "optimise, then distil three layouts": {"summary": "the layouts, then a distillation comparison of "
                                                           "optimised, contiguous and random-1000",
                                                "value": EXAMPLE_DISTILL_SPEC},
    })]) -> JSONResponse:
        app_state = request.app.state
        try:
            job = services.submit_job(db=app_state.db, settings=app_state.settings, spec=spec, owner=owner,
                                      enqueue=app_state.enqueue)
        except services.SpecError:
            app_state.metrics.rejected.inc()
            raise
        app_state.metrics.submitted.inc()
        body = JobOut.model_validate(_job_out(request, job)).model_dump(mode="json")
        return JSONResponse(status_code=202, content=body, headers={"Location": body["links"]["self"]})

    @v1.get("/jobs", response_model=JobList, tags=["jobs"], summary="List jobs (newest first)")
    def list_jobs(request: Request, _owner: Owner,
                  model: Annotated[str | None, Query(description="model id as submitted")] = None,
                  status: Annotated[Status | None, Query()] = None,
                  devices: Annotated[int | None, Query(ge=1, description="L")] = None,
                  delta: Annotated[int | None, Query(ge=0, description="δ")] = None,
                  owner: Annotated[str | None, Query(description="owner (API key name)")] = None,
                  limit: Annotated[int, Query(ge=1, le=200)] = 50,
                  offset: Annotated[int, Query(ge=0)] = 0) -> dict[str, Any]:
        rows, total = services.list_jobs(db=_db(request), model=model, status=status, devices=devices, delta=delta,
                                         owner=owner, limit=limit, offset=offset)
        nxt = None
        if offset + len(rows) < total:
            params = dict(request.query_params)
            params.update(limit=str(limit), offset=str(offset + limit))
            nxt = f"{_base(request)}/v1/jobs?" + urlencode(params)
        return {"items": [_job_out(request, r) for r in rows], "total": total, "limit": limit, "offset": offset,
                "next": nxt}

    @v1.get("/jobs/{job_id}", response_model=JobOut, tags=["jobs"], summary="A job: status, stage, progress, ETA",
            responses={404: {"description": "no such job"}})
    def get_job(request: Request, job_id: str, _owner: Owner) -> dict[str, Any]:
        return _job_out(request, services.get_job(db=_db(request), job_id=job_id))

    @v1.post("/jobs/{job_id}/cancel", status_code=202, response_model=JobOut, tags=["jobs"],
             summary="Cancel a job (a running one stops between micro-batches)",
             responses={404: {"description": "no such job"}, 409: {"description": "the job already finished"}})
    def cancel(request: Request, job_id: str, owner: Owner) -> dict[str, Any]:
        job = services.cancel_job(db=_db(request), job_id=job_id, owner=owner,
                                  auth_enabled=bool(request.app.state.api_keys))
        return _job_out(request, job)

    @v1.get("/jobs/{job_id}/layouts", response_model=LayoutList, tags=["layouts"],
            summary="The job's layouts and their scores")
    def layouts(request: Request, job_id: str, _owner: Owner) -> dict[str, Any]:
        rows = services.list_layouts(db=_db(request), job_id=job_id)
        base = f"{_base(request)}/v1/jobs/{job_id}/layouts"
        return {"items": [LayoutSummary(name=r.name, J=r.J, random_expectation=r.random_expectation,
                                        upper_bound=r.upper_bound, upper_bound_exact=r.upper_bound_exact,
                                        up_fraction=r.up_fraction, down_fraction=r.down_fraction,
                                        link=f"{base}/{r.name}") for r in rows]}

    @v1.get("/jobs/{job_id}/layouts/{name}", tags=["layouts"], summary="One layout as dtp-layout/1 JSON",
            responses={200: {"content": {"application/json": {"example": {
                "format": "dtp-layout/1", "name": "optimised", "devices": 3, "delta": 1,
                "model": {"model_type": "llama", "num_layers": 30, "num_kv_groups": 3, "num_query_heads": 9,
                          "intermediate_size": 1536, "hidden_size": 576, "head_dim": 64},
                "kv_group_device": [[0, 2, 1]], "neuron_device": [[2, 0, 1, 1]]}}}},
                404: {"description": "no such job or layout"}})
    def layout(request: Request, job_id: str, name: str, _owner: Owner) -> dict[str, Any]:
        return services.layout_document(db=_db(request), job_id=job_id, name=name)

    @v1.get("/jobs/{job_id}/artifacts", response_model=ArtifactList, tags=["artifacts"],
            summary="The job's artifacts: name, kind, size, sha256")
    def artifacts(request: Request, job_id: str, _owner: Owner) -> dict[str, Any]:
        rows = services.list_artifacts(db=_db(request), job_id=job_id)
        base = f"{_base(request)}/v1/jobs/{job_id}/artifacts"
        return {"items": [ArtifactOut(name=a.name, kind=a.kind, size=a.size, sha256=a.sha256,
                                      link=f"{base}/{a.name}") for a in rows]}

    @v1.head("/jobs/{job_id}/artifacts/{name:path}", include_in_schema=False)
    @v1.get("/jobs/{job_id}/artifacts/{name:path}", tags=["artifacts"],
            summary="Download an artifact (Range, ETag / If-None-Match, Digest)", response_class=StreamingResponse,
            responses={200: {"content": {"application/octet-stream": {}}},
                       206: {"description": "a byte range"}, 304: {"description": "not modified"},
                       404: {"description": "no such job or artifact"}, 416: {"description": "range not satisfiable"}})
    def download(request: Request, job_id: str, name: str, _owner: Owner) -> Response:
        state = request.app.state
        art = services.get_artifact(db=state.db, job_id=job_id, name=name)
        path = state.storage.path(art.storage_key)
        if not path.is_file():
            raise services.NotFound(f"artifact {name!r} of job {job_id!r} is missing from storage")
        size, etag = path.stat().st_size, f'"{art.sha256}"'
        b64 = base64.b64encode(bytes.fromhex(art.sha256)).decode()
        filename = PurePosixPath(art.name).name
        headers = {"ETag": etag, "Accept-Ranges": "bytes", "Digest": f"sha-256={b64}",
                   "Repr-Digest": f"sha-256=:{b64}:", "X-Checksum-SHA256": art.sha256,
                   "Content-Disposition": f'attachment; filename="{filename}"', "Cache-Control": "private, max-age=0"}
        inm = request.headers.get("if-none-match")
        if inm and (inm.strip() == "*" or etag in [t.strip().removeprefix("W/") for t in inm.split(",")]):
            return Response(status_code=304, headers=headers)
        media = "application/json" if filename.endswith(".json") else (
            mimetypes.guess_type(filename)[0] or "application/octet-stream")
        start, end, status = 0, size - 1, 200
        range_header = request.headers.get("range")
        if_range = request.headers.get("if-range")
        if range_header and (if_range is None or if_range.strip() == etag):
            parsed = _parse_range(range_header, size)
            if parsed == "unsatisfiable":
                return Response(status_code=416, headers={**headers, "Content-Range": f"bytes */{size}"})
            if isinstance(parsed, tuple):
                start, end, status = parsed[0], parsed[1], 206
                headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        length = max(0, end - start + 1)
        headers["Content-Length"] = str(length)
        if request.method == "HEAD":
            return Response(status_code=status, headers=headers, media_type=media)
        return StreamingResponse(_iter_file(path, start, length, state.metrics), status_code=status,
                                 headers=headers, media_type=media)

    @v1.get("/jobs/{job_id}/metrics", response_model=MetricsOut, tags=["jobs"],
            summary="Distillation curves per layout and seed (as produced), and the headline once done",
            responses={404: {"description": "no such job"}})
    def metrics(request: Request, job_id: str, _owner: Owner,
                layout: Annotated[str | None, Query(max_length=64, description="only this layout")] = None,
                seed: Annotated[int | None, Query(ge=0, description="only this training seed")] = None,
                name: Annotated[MetricName | None, Query(description="only this metric (the others are null)")] = None,
                ) -> dict[str, Any]:
        state = request.app.state
        return services.job_metrics(db=state.db, storage=state.storage, job_id=job_id, layout=layout, seed=seed,
                                    name=name)

    @v1.get("/scores", response_model=ScoresOut, tags=["scores"],
            summary="J per layout of the latest succeeded job matching the filters (for CI)",
            responses={404: {"description": "no finished job matches"}})
    def scores(request: Request, _owner: Owner,
               model: Annotated[str | None, Query(description="model id as submitted")] = None,
               revision: Annotated[str | None, Query()] = None,
               devices: Annotated[int | None, Query(ge=1)] = None,
               delta: Annotated[int | None, Query(ge=0)] = None,
               score: Annotated[str | None, Query(pattern="^(fo|add)$")] = None) -> dict[str, Any]:
        return services.latest_scores(db=_db(request), model=model, revision=revision, devices=devices, delta=delta,
                                      score=score)

    return v1


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    app = FastAPI(title="dtp-layout service", version="1", description=DESCRIPTION,
                  openapi_tags=[{"name": "jobs"}, {"name": "layouts"}, {"name": "artifacts"}, {"name": "scores"},
                                {"name": "health"}])
    db = database(settings.database_url)
    app.state.settings = settings
    app.state.db = db
    app.state.storage = Storage(settings.storage)
    app.state.api_keys = settings.api_key_table()
    app.state.metrics = metrics = Metrics(lambda: services.job_counts(db=db))
    app.state.celery = None

    def celery() -> Any:
        if app.state.celery is None:
            from worker.celery_app import make_celery

            app.state.celery = make_celery(settings)
        return app.state.celery

    def enqueue(job_id: str) -> None:
        from worker.celery_app import enqueue as send

        send(celery(), settings, job_id)

    app.state.enqueue = enqueue
    app.middleware("http")(metrics.middleware)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = []
        for err in exc.errors():
            item = {k: v for k, v in err.items() if k in ("loc", "msg", "type", "input")}
            item["field"] = _field(err.get("loc", ()))
            if "ctx" in err:
                item["ctx"] = {k: str(v) for k, v in err["ctx"].items()}
            errors.append(item)
        return _unprocessable(errors)

    @app.exception_handler(services.SpecError)
    async def _spec(_request: Request, exc: services.SpecError) -> JSONResponse:
        return _unprocessable([{"loc": ["body", *field.split(".")], "field": field, "msg": message,
                                "type": "value_error"} for field, message in exc.problems])

    for exc_type, code in ((services.NotFound, 404), (services.Conflict, 409), (services.Forbidden, 403),
                           (services.BrokerUnavailable, 503)):
        def _handler(_request: Request, exc: Exception, code: int = code) -> JSONResponse:
            return JSONResponse(status_code=code, content={"detail": str(exc)})

        app.add_exception_handler(exc_type, _handler)

    app.include_router(build_router())

    @app.get("/healthz", response_model=Health, tags=["health"], summary="The API process is up")
    def healthz() -> dict[str, Any]:
        return {"status": "ok", "checks": {}}

    @app.get("/readyz", response_model=Health, tags=["health"], summary="Database and broker reachable",
             responses={503: {"description": "a dependency is unreachable"}})
    def readyz() -> JSONResponse:
        checks: dict[str, str] = {}
        try:
            services.check_database(db=db)
            checks["database"] = "ok"
        except Exception as exc:
            checks["database"] = f"error: {type(exc).__name__}: {exc}"[:300]
        try:
            with celery().connection_for_write() as conn:
                conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0.2, timeout=3)
            checks["broker"] = "ok"
        except Exception as exc:
            checks["broker"] = f"error: {type(exc).__name__}: {exc}"[:300]
        ok = all(v == "ok" for v in checks.values())
        return JSONResponse(status_code=200 if ok else 503, content={"status": "ok" if ok else "unavailable",
                                                                     "checks": checks})

    @app.get("/metrics", tags=["health"], summary="Prometheus metrics", response_class=Response)
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(HTTPException)
    async def _http(_request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code, content={"detail": exc.detail},
                            headers=getattr(exc, "headers", None))

    return app
