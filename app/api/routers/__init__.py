"""The API's routers, one module per resource: `jobs` (submit, list, read, cancel, distillation
curves, delete), `spec` (what a job may leave out), `layouts`, `artifacts`, `scores`, `uploads` (a
tenant's own models and data), `usage` (its storage and quota) (/v1) and `health`
(/healthz, /readyz, /metrics)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from app.api.deps import known_query_only
from app.api.routers import artifacts, health, jobs, layouts, scores, spec, uploads, usage


def v1_router() -> APIRouter:
    """Every /v1 operation."""
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(known_query_only)])
    for module in (jobs, spec, layouts, artifacts, scores, uploads, usage):
        v1.include_router(module.router)
    return v1


__all__ = ["health", "v1_router"]
