"""/v1/jobs/{job_id}/layouts: a job's layouts with their scores, and each as dtp-layout/1 JSON."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path

from app.api.deps import BaseUrl, CallerDep, DbDep
from app.api.errors import responses
from app.core.schemas.reads import LayoutList, LayoutSummary
from app.core.services import jobs as services
from models.base.layout_format import LAYOUT_FORMAT

router = APIRouter(prefix="/jobs/{job_id}/layouts", tags=["layouts"])

JobId = Annotated[str, Path(max_length=64, description="the job id (32 hex digits)")]
LAYOUT_EXAMPLE = {"format": LAYOUT_FORMAT, "name": "optimised", "devices": 3, "delta": 1,
                  "model": {"model_type": "llama", "num_layers": 30, "num_kv_groups": 3, "num_query_heads": 9,
                            "intermediate_size": 1536, "hidden_size": 576, "head_dim": 64},
                  "kv_group_device": [[0, 2, 1]], "neuron_device": [[2, 0, 1, 1]]}


@router.get("", response_model=LayoutList, operation_id="list_layouts", summary="The job's layouts and their scores",
            responses=responses(404))
async def list_layouts(job_id: JobId, db: DbDep, caller: CallerDep, base: BaseUrl) -> dict[str, Any]:
    rows = await db.run(lambda s: services.list_layouts(session=s, job_id=job_id, caller=caller))
    url = f"{base}/v1/jobs/{job_id}/layouts"
    return {"items": [LayoutSummary(name=r.name, J=r.J, random_expectation=r.random_expectation,
                                    upper_bound=r.upper_bound, upper_bound_exact=r.upper_bound_exact,
                                    up_fraction=r.up_fraction, down_fraction=r.down_fraction,
                                    link=f"{url}/{r.name}") for r in rows]}


@router.get("/{name}", operation_id="get_layout", summary=f"One layout as {LAYOUT_FORMAT} JSON",
            responses={200: {"content": {"application/json": {"schema": {"type": "object"},
                                                              "example": LAYOUT_EXAMPLE}}},
                       **responses(404, _404="no such job or layout")})
async def get_layout(job_id: JobId, name: Annotated[str, Path(max_length=64, description="layout name")],
                     db: DbDep, caller: CallerDep) -> dict[str, Any]:
    return await db.run(lambda s: services.layout_document(session=s, job_id=job_id, name=name, caller=caller))
