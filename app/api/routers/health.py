"""/healthz, /readyz and /metrics: for load balancers and Prometheus, without a key.

They disclose no job, tenant, exception text or server path: readiness says which dependency is
down (the broker also when it serves another database), and the reason goes to the server's log.
/readyz answers from app.api.readiness's cache (its round trips at most once per 1.5 s) on the event
loop, and is rate-limited per client address like a keyless /v1 request."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.api.errors import ErrorOut
from app.api.ratelimit import RateLimiter
from app.api.readiness import Readiness
from app.core.errors import TooManyRequests
from app.core.schemas.reads import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, operation_id="healthz", summary="The API process is up")
def healthz() -> dict[str, Any]:
    return {"status": "ok", "checks": {}}


@router.get("/readyz", response_model=Health, operation_id="readyz",
            summary="Database and broker reachable, the broker this database's",
            responses={503: {"model": Health, "description": "a dependency is unreachable, or the broker serves "
                                                             "another database (named in `checks`)"},
                       429: {"model": ErrorOut, "description": "this address's requests are past the rate limit"}})
async def readyz(request: Request) -> JSONResponse:
    state = request.app.state
    limiter: RateLimiter = state.rate_limiter
    wait = limiter.take(f"readyz:{request.client.host if request.client else 'unknown'}")
    if wait > 0:
        raise TooManyRequests(f"rate limit: at most {round(limiter.rate * 60)} requests per minute per client address; "
                              f"retry after {wait:.1f} s", field="readyz", retry_after_s=wait)
    readiness: Readiness = state.readiness
    ok, checks = await readiness.answer()
    return JSONResponse(status_code=200 if ok else 503, content={"status": "ok" if ok else "unavailable",
                                                                 "checks": checks})


@router.get("/metrics", operation_id="prometheus_metrics", summary="Prometheus metrics (no per-job or tenant data)",
            response_class=Response, responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
def prometheus(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
