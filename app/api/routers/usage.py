"""/v1/usage: what the caller's tenant keeps in the store (bytes by kind, counts) against its quota."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from app.api.deps import CallerDep, DbDep, SettingsDep
from app.api.errors import responses
from app.core.schemas.uploads import UsageOut
from app.core.services.usage import usage as tenant_usage

router = APIRouter(tags=["uploads"])


@router.get("/usage", response_model=UsageOut, operation_id="usage",
            summary="The tenant's storage: bytes of uploads and artifacts, its quota, counts", responses=responses())
async def usage(db: DbDep, settings: SettingsDep, caller: CallerDep) -> dict[str, Any]:
    return await db.run(lambda s: tenant_usage(session=s, settings=settings, caller=caller))
