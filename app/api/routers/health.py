"""/healthz, /readyz and /metrics: for load balancers and Prometheus, without a key.

They disclose no job, tenant, exception text or server path: readiness says which dependency is
down, and the reason goes to the server's log."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.core.schemas.reads import Health
from app.core.services import jobs as services

log = logging.getLogger(__name__)
router = APIRouter(tags=["health"])
UNREACHABLE = "error: unreachable (the reason is in the server's log)"


@router.get("/healthz", response_model=Health, operation_id="healthz", summary="The API process is up")
def healthz() -> dict[str, Any]:
    return {"status": "ok", "checks": {}}


@router.get("/readyz", response_model=Health, operation_id="readyz", summary="Database and broker reachable",
            responses={503: {"model": Health, "description": "a dependency is unreachable (named in `checks`)"}})
def readyz(request: Request) -> JSONResponse:
    state = request.app.state
    checks: dict[str, str] = {}
    for name, probe in (("database", lambda: services.check_database(db=state.db)), ("broker", state.queue.ping)):
        try:
            probe()
            checks[name] = "ok"
        except Exception:
            log.warning("readyz: the %s is unreachable", name, exc_info=True)
            checks[name] = UNREACHABLE
    ok = all(v == "ok" for v in checks.values())
    return JSONResponse(status_code=200 if ok else 503, content={"status": "ok" if ok else "unavailable",
                                                                 "checks": checks})


@router.get("/metrics", operation_id="prometheus_metrics", summary="Prometheus metrics (no per-job or tenant data)",
            response_class=Response, responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
def prometheus(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
