"""Every request's context: its `X-Request-ID`, its log context, its access-log line and its metrics.

One pure ASGI middleware (no `BaseHTTPMiddleware`: that wraps every request in an extra task and
stream, a measurable cost under load):

- the request id is the client's `X-Request-ID` when it is sane (1-128 characters of
  `A-Z a-z 0-9 . _ : = + / -`: it goes into logs and the job history verbatim), else a new uuid4;
  the response carries it back, and the route sees it as `request.state.request_id`;
- the log context (`app/core/logs.py`) holds the request id for the whole request, and the tenant and job
  once the dependencies and services know them;
- one access-log line per request (`dtp_layout.access`: method, path, route, status, ms);
- the request counters and latency histogram, 5xx answers and unhandled exceptions (`app/api/metrics.py`).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.metrics import Metrics
from app.core import logs

HEADER = "X-Request-ID"
_HEADER_KEY = HEADER.lower().encode()
SANE_ID = re.compile(rb"[A-Za-z0-9._:=+/-]{1,128}")
_JOB_ID = re.compile(r"[0-9a-f]{32}")
access_log = logging.getLogger("dtp_layout.access")


def request_id_from(headers: list[tuple[bytes, bytes]] | Any) -> str:
    """The client's X-Request-ID if it is sane, else a fresh one (32 hex digits)."""
    for name, value in headers:
        if name == _HEADER_KEY:
            if SANE_ID.fullmatch(value):
                return str(value.decode("ascii"))
            break
    return uuid.uuid4().hex


def route_template(scope: Scope) -> str:
    """The matched route's path template with its routers' prefixes (`/v1/jobs/{job_id}`): a bounded
    label. FastAPI ≥ 0.16x keeps an included router's routes unprefixed (`scope["route"].path` is
    `/jobs/{job_id}`) and records the full path in its effective route context; older ones prefix the
    route itself."""
    effective = (scope.get("fastapi") or {}).get("effective_route_context")
    path = getattr(effective, "path", None) or getattr(scope.get("route"), "path", None)
    return path if isinstance(path, str) else "unmatched"


class RequestContext:
    def __init__(self, app: ASGIApp, metrics: Metrics, access: bool = True) -> None:
        self.app, self.metrics, self.access = app, metrics, access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        rid = request_id_from(scope.get("headers", ()))
        scope.setdefault("state", {})["request_id"] = rid
        rid_header = (_HEADER_KEY, rid.encode())
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), rid_header]
            await send(message)

        with logs.bound(request_id=rid) as ctx:
            unhandled = False
            try:
                await self.app(scope, receive, send_with_id)
            except Exception:
                unhandled, status = True, 500  # the outer ServerErrorMiddleware answers 500 and logs it
                raise
            finally:
                self._done(scope, ctx, status, time.perf_counter() - t0, unhandled)

    def _done(self, scope: Scope, ctx: logs.LogContext, status: int, seconds: float, unhandled: bool) -> None:
        route = route_template(scope)
        self.metrics.observe(scope["method"], route, status, seconds, unhandled=unhandled)
        if ctx.job_id is None:
            job_id = (scope.get("path_params") or {}).get("job_id")
            if isinstance(job_id, str) and _JOB_ID.fullmatch(job_id):
                ctx.job_id = job_id
        if self.access and access_log.isEnabledFor(logging.INFO):
            client = scope.get("client")
            access_log.info("%s %s %d %.1f ms", scope["method"], scope["path"], status, seconds * 1000,
                            extra={"method": scope["method"], "path": scope["path"], "route": route,
                                   "status": status, "ms": round(seconds * 1000, 2),
                                   "client": client[0] if client else None})


def install(app: Any, metrics: Metrics, *, access_log: bool = True) -> None:
    app.add_middleware(RequestContext, metrics=metrics, access=access_log)
