"""/v1/spec: the job spec's defaults, the fields a job must give, the texts this server can read, and an
example job it can run (what the dashboard's submit form starts from)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from app.api.deps import CallerDep, SettingsDep
from app.api.errors import responses
from app.core.schemas.jobs import SpecInfo
from app.core.services.spec_info import spec_info

router = APIRouter(tags=["jobs"])


@router.get("/spec", response_model=SpecInfo, operation_id="job_spec_info",
            summary="What POST /v1/jobs accepts here: defaults, required fields, sources, a runnable example",
            responses=responses())
def spec(settings: SettingsDep, _caller: CallerDep) -> dict[str, Any]:
    # sync: it looks at the disk (the corpora, the data root), so FastAPI runs it in a worker thread
    return spec_info(settings=settings)
