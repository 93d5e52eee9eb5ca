"""Every failure the API answers is JSON that names what is wrong: the error models, the exceptions
the services raise, their handlers, and the OpenAPI `responses` that document each status code.

Two bodies: `ErrorOut` (`detail` and the `field` at fault: a spec field, a parameter, a header or
`body`) for 401/404/409/413/416/429/503, and `ValidationErrorOut` (one entry per bad field, and a
`message` joining them) for 422. Nothing else leaves the API: a database outage is a 503, a body
that cannot be parsed a 422, and no answer carries exception text or a server path.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException

from app.core.errors import (  # noqa: F401  (raised by routes, answered here)
    ApiError,
    ArtifactDamaged,
    BrokerUnavailable,
    Conflict,
    Gone,
    NotFound,
    PayloadTooLarge,
    RangeNotSatisfiable,
    ServiceUnavailable,
    SpecError,
    StoreUnreachable,
    TooManyRequests,
    Unauthorized,
    redact_paths,
)
from app.core.storage.root import StoreUnavailable

log = logging.getLogger(__name__)


# ---- the bodies ------------------------------------------------------------------------------------

class ErrorOut(BaseModel):
    detail: str = Field(description="what is wrong, and what would be accepted")
    field: str | None = Field(default=None, description="the part of the request at fault: a spec field "
                                                        "(`calibration.seq_len`), a path or query parameter, a header "
                                                        "(`X-API-Key`) or `body`; null for a server-side outage (503)")
    error: str | None = Field(default=None, description="a short code for programs: unauthorized, not_found, "
                                                        "conflict, request_timeout, payload_too_large, "
                                                        "range_not_satisfiable, "
                                                        "rate_limited, too_many_active_jobs, work_budget, "
                                                        "database_unavailable, broker_unavailable, "
                                                        "artifact_damaged, …")


class FieldError(BaseModel):
    field: str = Field(description="the bad field, dotted (`distill.recipe.lr`), or `body`")
    msg: str
    type: str
    loc: list[str | int]
    input: Any = Field(default=None, description="the value sent, when it is short")
    ctx: dict[str, str] | None = None


class ValidationErrorOut(BaseModel):
    detail: list[FieldError] = Field(description="one entry per bad field")
    message: str = Field(description="the entries joined, for people")


# ---- handlers --------------------------------------------------------------------------------------

def error_response(status: int, detail: str, field: str | None, headers: dict[str, str] | None = None, *,
                   code: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"detail": detail, "field": field, "error": code},
                        headers=headers)


def unprocessable(errors: list[dict[str, Any]]) -> JSONResponse:
    message = "; ".join(f"{e['field']}: {e['msg']}" for e in errors)
    return JSONResponse(status_code=422, content={"detail": errors, "message": f"invalid request: {message}"})


def _field(loc: Iterable[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


def _short(value: Any) -> bool:
    """A value worth echoing: short and JSON-safe (not inf or NaN, not a 10^400-digit integer)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, int):
        return value.bit_length() <= 64
    return value is None or (isinstance(value, str) and len(value) <= 200)


def _field_error(err: dict[str, Any]) -> dict[str, Any]:
    loc = [p if isinstance(p, int) else str(p) for p in err.get("loc", ())]
    item: dict[str, Any] = {"field": _field(loc), "msg": str(err.get("msg", "")), "type": str(err.get("type", "")),
                            "loc": loc}
    if _short(err.get("input")):
        item["input"] = err.get("input")
    if "ctx" in err:
        item["ctx"] = {k: str(v) for k, v in err["ctx"].items()}
    return item


_HTTP_FIELDS = {404: "path", 405: "method", 413: "body", 415: "Content-Type"}
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large", 415: "unsupported_media_type"}


MORE_PROBLEMS = "more_problems"  # an endpoint's attribute: async (request, body, fields reported) → (field, msg)


def install(app: FastAPI) -> None:
    """The exception handlers that turn every failure into one of the two JSON bodies."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [_field_error(err) for err in exc.errors()]
        # A route may add what its own checks find in the rest of the body (`more_problems` on its
        # endpoint: the submit route's model and data sources), so that one answer names every problem.
        more = getattr(getattr(request.scope.get("route"), "endpoint", None), MORE_PROBLEMS, None)
        if more is not None and isinstance(getattr(exc, "body", None), dict):
            problems = await more(request, exc.body, {e["field"] for e in errors})
            errors += [{"loc": ["body", *field.split(".")], "field": field, "msg": message, "type": "value_error"}
                       for field, message in problems]
        return unprocessable(errors)

    @app.exception_handler(SpecError)
    async def _spec(_request: Request, exc: SpecError) -> JSONResponse:
        return unprocessable([{"loc": ["body", *field.split(".")], "field": field, "msg": message,
                               "type": "value_error"} for field, message in exc.problems])

    @app.exception_handler(ApiError)
    async def _api(_request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.detail, exc.field, exc.headers, code=exc.code)

    @app.exception_handler(HTTPException)
    async def _http(_request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 400:  # FastAPI could not parse the body (e.g. JSON nested too deeply)
            return unprocessable([{"field": "body", "loc": ["body"], "type": "json_invalid",
                                   "msg": "the body is not a JSON document this API can read (malformed, or "
                                          "nested too deeply)"}])
        return error_response(exc.status_code, str(exc.detail), _HTTP_FIELDS.get(exc.status_code, "path"),
                              getattr(exc, "headers", None), code=_HTTP_CODES.get(exc.status_code, "http_error"))

    @app.exception_handler(OperationalError)
    @app.exception_handler(PoolTimeout)
    async def _database_down(_request: Request, exc: Exception) -> JSONResponse:
        log.warning("database unreachable: %s", exc)
        return error_response(503, "the database is unreachable; try again shortly", None, {"Retry-After": "5"},
                              code="database_unavailable")

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        # A bug: the traceback goes to the log, the caller gets JSON without internals. Starlette calls
        # this outside every middleware, so the request id is taken from the request's state.
        rid = getattr(request.state, "request_id", None)
        if isinstance(exc, StoreUnavailable) or type(exc).__module__.split(".")[0] in ("botocore", "boto3"):
            # the object store failed a call (after botocore's own retries) where no route mapped it to
            # StoreUnreachable: the same outage answer, not a bug
            log.warning("object store error [request_id=%s]: %s", rid, exc)
            return error_response(503, "the object store failed the request (logged); try again shortly", None,
                                  {"Retry-After": "5"}, code=StoreUnreachable.code)
        log.error("unhandled error", exc_info=exc, extra={"request_id": rid})
        return error_response(500, f"internal error (logged on the server with request id {rid})", None,
                              {"X-Request-ID": rid} if rid else None, code="internal_error")

    @app.exception_handler(DBAPIError)
    async def _database_error(_request: Request, exc: DBAPIError) -> JSONResponse:
        if exc.connection_invalidated:
            log.warning("database connection lost: %s", exc)
            return error_response(503, "the database is unreachable; try again shortly", None, {"Retry-After": "5"},
                                  code="database_unavailable")
        log.error("database error", exc_info=exc)
        return error_response(503, "the database refused the request (logged); try again or report it", None,
                              code="database_error")


# ---- OpenAPI ---------------------------------------------------------------------------------------

_DESCRIPTIONS = {
    401: "missing, unknown or revoked X-API-Key",
    404: "no such job (or not the caller's)",
    408: "the request's headers or body did not arrive in time (DTP_LAYOUT_HEADER_TIMEOUT_S, "
         "DTP_LAYOUT_BODY_TIMEOUT_S); the connection is closed",
    409: "the job already finished",
    410: "removed on purpose (a job's artifacts after DELETE /v1/jobs/{id} or the retention period)",
    413: "request body larger than the server's limit (DTP_LAYOUT_MAX_BODY_BYTES)",
    416: "the Range is not satisfiable",
    422: "invalid request: every bad field is named",
    429: "rate limit, or the tenant's active-job or token budget, is exhausted: retry after Retry-After seconds",
    503: "the database or the job broker is unreachable",
}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
_HEADERS = {401: {"WWW-Authenticate": {"description": "X-API-Key", "schema": {"type": "string"}}},
            429: _RETRY_AFTER, 503: _RETRY_AFTER}
COMMON = (401, 408, 413, 422, 429, 503)


def responses(*codes: int, **descriptions: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the common failures of a /v1 operation and `codes`; `descriptions`
    (`_404="no such layout"`) override the wording."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in sorted({*COMMON, *codes}):
        entry: dict[str, Any] = {"description": descriptions.get(f"_{code}", _DESCRIPTIONS[code]),
                                 "model": ValidationErrorOut if code == 422 else ErrorOut}
        if code in _HEADERS:
            entry["headers"] = _HEADERS[code]
        out[code] = entry
    return out


