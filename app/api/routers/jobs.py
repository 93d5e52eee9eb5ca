"""/v1/jobs: submit, list, read, cancel and delete jobs, and read a job's distillation curves."""

from __future__ import annotations

import functools
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Body, Path, Query, Request
from fastapi.responses import JSONResponse
from sqlalchemy.orm import Session

from app.api.auth import STATE_KEY
from app.api.deps import (
    BaseUrl,
    CallerDep,
    Db,
    DbDep,
    QueueDep,
    RequestIdDep,
    SessionDep,
    SettingsDep,
    StorageDep,
    releases_session,
)
from app.api.errors import MORE_PROBLEMS, responses
from app.core import events
from app.core.caller import Caller
from app.core.db import JobEvent
from app.core.errors import SpecError
from app.core.schemas.jobs import (
    EXAMPLE_DISTILL_SPEC,
    EXAMPLE_HUB_SPEC,
    EXAMPLE_SPEC,
    INT32_MAX,
    JobSpec,
    MetricName,
    Status,
)
from app.core.schemas.reads import (
    DeltaFilter,
    JobList,
    JobOut,
    LayoutFilter,
    MetricsOut,
    ModelFilter,
    OwnerFilter,
    ScheduleFilter,
)
from app.core.services import jobs as services
from app.core.services.uploads import resolve_ref

router = APIRouter(prefix="/jobs", tags=["jobs"])

JobId = Annotated[str, Path(max_length=64, description="the job id (32 hex digits)")]
SPEC_EXAMPLES = {
    "packaged SmolLM2 on the corpus": {"summary": "the model `dtp-layout serve` provides", "value": EXAMPLE_SPEC},
    "hub model, data-root tokens": {"summary": "a hub model and a .npy under the data root", "value": EXAMPLE_HUB_SPEC},
    "optimise, then distil three layouts": {"summary": "the layouts, then a distillation comparison of optimised, "
                                                       "contiguous and random-1000", "value": EXAMPLE_DISTILL_SPEC},
}
# OpenAPI links: what a client (or a fuzzer) can do with the id of a submitted job.
_JOB_LINKS = {f"{op}": {"operationId": op, "parameters": {"job_id": "$response.body#/id"}}
              for op in ("get_job", "cancel_job", "job_metrics", "list_layouts", "list_artifacts")}


def job_out(request: Request, session: Session, job: Any, base: str,
            history: list[JobEvent] | None = None) -> dict[str, Any]:
    """The job's view; `history`: its events when already read (a page of jobs reads them in one query)."""
    return services.job_view(job, history=events.job_events(session, job.id) if history is None else history,
                             base=base, roots=services.public_roots(request.app.state.settings))


@router.post("", status_code=202, response_model=JobOut, operation_id="submit_job", summary="Submit a layout job",
             responses={202: {"links": _JOB_LINKS, "headers": {"Location": {"description": "the job's URL",
                                                                            "schema": {"type": "string"}}}},
                        **responses()})
@releases_session
def submit(request: Request, session: SessionDep, settings: SettingsDep, queue: QueueDep, caller: CallerDep,
           base: BaseUrl, rid: RequestIdDep, spec: Annotated[JobSpec, Body(openapi_examples=SPEC_EXAMPLES)]
           ) -> JSONResponse:
    metrics = request.app.state.metrics
    try:
        job = services.submit_job(session=session, settings=settings, spec=spec, caller=caller,
                                  enqueue=functools.partial(queue.enqueue, world_size=spec.distill.world_size
                                                            if spec.distill else 1),
                                  request_id=rid)
    except SpecError:
        metrics.rejected.inc()
        raise
    metrics.submitted.inc()
    body = JobOut.model_validate(job_out(request, session, job, base)).model_dump(mode="json")
    return JSONResponse(status_code=202, content=body, headers={"Location": body["links"]["self"]})


async def submit_problems(request: Request, body: dict[str, Any], reported: set[str]) -> list[tuple[str, str]]:
    """A body that failed validation: what the submit's source checks find in it besides (the 422 names all)."""
    settings = request.app.state.settings
    who = request.scope.get("state", {}).get(STATE_KEY)
    tenant = who.tenant if isinstance(who, Caller) else None

    def check(session: Session) -> list[tuple[str, str]]:
        def uploads(ref: str, kind: str, field: str) -> Any:
            return resolve_ref(session, ref, tenant=tenant, kind=kind, field=field)

        return services.source_problems(settings=settings, body=body, uploads=uploads, reported=reported)

    db: Db = request.app.state.db_runner
    return await db.run(check)


setattr(submit, MORE_PROBLEMS, submit_problems)


@router.get("", response_model=JobList, operation_id="list_jobs", summary="List the caller's jobs (newest first)",
            responses=responses())
async def list_jobs(request: Request, db: DbDep, caller: CallerDep, base: BaseUrl,
              model: ModelFilter = None,
              status: Annotated[Status | None, Query()] = None,
              devices: Annotated[int | None, Query(ge=1, le=1024, description="L")] = None,
              delta: DeltaFilter = None, schedule: ScheduleFilter = None,
              owner: OwnerFilter = None,
              limit: Annotated[int, Query(ge=1, le=200)] = 50,
              offset: Annotated[int, Query(ge=0, le=INT32_MAX)] = 0) -> dict[str, Any]:
    def read(session: Session) -> tuple[list[dict[str, Any]], int]:
        rows, total = services.list_jobs(session=session, caller=caller, model=model, status=status, devices=devices,
                                         delta=delta, schedule=schedule, owner=owner, limit=limit,
                                         offset=offset)
        history = events.events_by_job(session, [r.id for r in rows])
        return [job_out(request, session, r, base, history[r.id]) for r in rows], total

    items, total = await db.run(read)
    nxt = None
    if offset + len(items) < total:
        params = dict(request.query_params)
        params.update(limit=str(limit), offset=str(offset + limit))
        nxt = f"{base}/v1/jobs?" + urlencode(params)
    return {"items": items, "total": total, "limit": limit, "offset": offset, "next": nxt}


@router.get("/{job_id}", response_model=JobOut, operation_id="get_job", summary="A job: status, stage, progress, ETA",
            responses=responses(404))
async def get_job(request: Request, job_id: JobId, db: DbDep, caller: CallerDep, base: BaseUrl) -> dict[str, Any]:
    return await db.run(lambda s: job_out(request, s, services.get_job(session=s, job_id=job_id, caller=caller),
                                          base))


@router.post("/{job_id}/cancel", status_code=202, response_model=JobOut, operation_id="cancel_job",
             summary="Cancel a job (a running one stops between micro-batches)", responses=responses(404, 409))
@releases_session
def cancel(request: Request, job_id: JobId, session: SessionDep, caller: CallerDep, base: BaseUrl,
           rid: RequestIdDep) -> dict[str, Any]:
    job = services.cancel_job(session=session, job_id=job_id, caller=caller, request_id=rid)
    return job_out(request, session, job, base)


@router.delete("/{job_id}", response_model=JobOut, operation_id="delete_job",
               summary="Delete a finished job's artifacts (the job, its layouts and scores stay, marked expired)",
               responses=responses(404, 409, _409="the job is queued or running (cancel it first)"))
@releases_session
def delete(request: Request, job_id: JobId, session: SessionDep, storage: StorageDep, caller: CallerDep,
           base: BaseUrl) -> dict[str, Any]:
    job = services.delete_job(session=session, storage=storage, job_id=job_id, caller=caller)
    return job_out(request, session, job, base)


@router.get("/{job_id}/metrics", response_model=MetricsOut, operation_id="job_metrics",
            summary="Distillation curves per layout and seed (as produced), and the headline once done",
            responses=responses(404))
@releases_session
def metrics(job_id: JobId, session: SessionDep, storage: StorageDep, caller: CallerDep,
            layout: LayoutFilter = None,
            seed: Annotated[int | None, Query(ge=0, le=INT32_MAX, description="only this training seed")] = None,
            name: Annotated[MetricName | None, Query(description="only this metric (the others are null)")] = None,
            ) -> dict[str, Any]:
    return services.job_metrics(session=session, storage=storage, job_id=job_id, caller=caller, layout=layout,
                                seed=seed, name=name)
