"""/v1/scores: J per layout of the caller's latest succeeded job matching the filters (for CI)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from app.api.deps import CallerDep, DbDep
from app.api.errors import responses
from app.core.schemas.reads import (
    DeltaFilter,
    ModelFilter,
    OwnerFilter,
    RevisionFilter,
    ScheduleFilter,
    ScoresOut,
)
from app.core.services import jobs as services

router = APIRouter(tags=["scores"])


@router.get("/scores", response_model=ScoresOut, operation_id="latest_scores",
            summary="J per layout of the caller's latest succeeded job matching the filters (for CI)",
            responses=responses(404, _404="none of the caller's finished jobs matches"))
async def scores(db: DbDep, caller: CallerDep,
           model: ModelFilter = None, revision: RevisionFilter = None,
           devices: Annotated[int | None, Query(ge=1, le=1024)] = None,
           delta: DeltaFilter = None, schedule: ScheduleFilter = None,
           score: Annotated[str | None, Query(pattern="^(fo|add)$")] = None,
           owner: OwnerFilter = None) -> dict[str, Any]:
    return await db.run(lambda s: services.latest_scores(session=s, caller=caller, model=model, revision=revision,
                                                         devices=devices, delta=delta, schedule=schedule,
                                                         score=score, owner=owner))
