"""The layout service's HTTP API (FastAPI). `create_app()` builds it from the settings.

The routes live in `app/api/routers/` (one module per resource) and take their settings, database
session, storage, queue and calling tenant as dependencies (`app/api/deps.py`); what they do is in
`app/core/services/jobs.py`. This process never imports torch or `worker/`: jobs are enqueued by task name
through `app/core/queue.py`. Run it with `dtp-layout serve` (embedded default) or
`uvicorn app.api.main:create_app --factory`.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from app.api import auth, body_limit, errors, request_context
from app.api.check_slots import CheckSlots
from app.api.deps import Db
from app.api.metrics import Metrics
from app.api.ratelimit import RateLimiter
from app.api.readiness import Readiness
from app.api.routers import health, uploads, v1_router
from app.core import logs
from app.core.db import database
from app.core.jobstate import STAGES
from app.core.keys import KeyRing
from app.core.queue import JobQueue
from app.core.services import jobs as services
from app.core.services.job_stats import CachedStats, job_stats
from app.core.services.submit_warmup import warm_submit
from app.core.services.upload_checks import start_checker
from app.core.settings import Settings, get_settings
from app.core.storage.root import Storage
from app.ui.docs.router import router as docs_router
from app.ui.router import router as ui_router

# The stage list is models/run/stage_names.py's (through app.core.jobstate), never spelled out here.
DESCRIPTION = f"""\
Affinity-aware layouts for Delayed Tensor Parallelism as a service: POST a model and a calibration
spec, a worker runs the affinity pass and the layout optimiser, and the optimised layout, its scores
and the permuted / per-rank sharded checkpoints come back as downloadable artifacts.

A job moves `queued → running → succeeded | failed | cancelled`; while running it reports its stage
(those its spec asks for, in this order: {", ".join(f"`{stage}`" for stage in STAGES)}), the fraction
of the stage done and an ETA. The distillation curves come from `GET /v1/jobs/{{id}}/metrics` as they
are produced.

""" + """\
**Keys and tenants.** Once the server has any API key, every /v1 call needs `X-API-Key`. A key
belongs to a tenant and sees only its tenant's jobs (another tenant's job is a 404); an admin key
sees and cancels all.

**Errors.** Every failure is JSON: `{"detail", "field"}` naming the part of the request at fault
(401, 404, 408, 409, 413, 416, 429, 503), or for 422 one entry per bad field under `detail` and a
`message`. 429 (rate limit, or the tenant's active jobs or work tokens) carries `Retry-After`.
Unknown paths are 404 and unsupported methods 405, with the same body. Under /v1 the key and the rate
limit are checked first, before the body is read: without a valid key every /v1 request is 401.
A request whose headers or body do not arrive in time is closed (408).
"""


_frozen = False


def freeze_startup_heap() -> None:
    """Take what is loaded at startup out of the cyclic garbage collector's reach, once per process.

    Everything loaded by then (FastAPI, pydantic, SQLAlchemy, the routes: ~160k objects) lives as long as
    the process. Left in the collector's oldest generation, every full collection walks it all again:
    107-315 ms with the GIL held on the 2-core test machine under 200 requests/s, most of the load
    test's p99 (docs/reliability.md "## Load"). Frozen, a full collection walks only what came after
    (11-48 ms). Once: a process that builds many apps (the tests) would otherwise freeze each one's
    garbage for good."""
    global _frozen
    if not _frozen:
        _frozen = True
        gc.collect()
        gc.freeze()


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    logs.configure(settings.log_format, settings.log_level)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # The worker threads that run sync routes: as many as the database pool has connections.
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.api_threads
        # The broker must serve this database, as `serve` and `worker` check (BrokerServesAnother stops the start).
        await run_in_threadpool(_app.state.readiness.startup)
        # The first submit as fast as the next: model metadata read, check modules imported, broker opened
        # (before the heap is frozen: what it imports lives as long as the process).
        await run_in_threadpool(warm_submit, settings, _app.state.queue, _app.state.db)
        freeze_startup_heap()
        # The upload checks' fork server imports in the background: startup does not wait for it.
        threading.Thread(target=start_checker, name="upload-checker", daemon=True).start()
        yield

    # /docs and /redoc come from this package (app/ui/docs), not from FastAPI's CDN pages.
    app = FastAPI(title="dtp-layout service", version="1", description=DESCRIPTION, lifespan=lifespan,
                  docs_url=None, redoc_url=None,
                  openapi_tags=[{"name": "jobs"}, {"name": "layouts"}, {"name": "artifacts"}, {"name": "scores"},
                                {"name": "uploads"}, {"name": "health"}])
    db = database(settings.database_url, pool_size=settings.api_threads)
    app.state.settings = settings
    app.state.db = db
    app.state.db_runner = Db(db)
    app.state.storage = Storage.from_settings(settings)
    app.state.keys = KeyRing(settings, db)
    app.state.rate_limiter = RateLimiter(settings.rate_limit_per_min, settings.rate_limit_burst)
    app.state.queue = JobQueue(settings)
    app.state.readiness = Readiness(settings, lambda: services.check_database(db=db), app.state.queue.ping)
    app.state.upload_checks = CheckSlots(total=settings.upload_checks_max, per_tenant=settings.upload_checks_per_tenant)
    stats = CachedStats(lambda: job_stats(db=db), settings.metrics_cache_s)
    app.state.metrics = metrics = Metrics(stats.get)
    # an oversized or stalled body never reaches the app
    part = body_limit.Wider("PUT", uploads.PART_PATH, settings.upload_part_bytes, settings.upload_part_timeout_s,
                            "DTP_LAYOUT_UPLOAD_PART_BYTES", "DTP_LAYOUT_UPLOAD_PART_TIMEOUT_S")
    body_limit.install(app, settings.max_body_bytes, settings.body_timeout_s, wider=(part,))
    auth.install(app)  # before the body is read: 401 / 429 for /v1 without parsing a byte of it
    # outermost: every answer (a 401, 413 included) carries its X-Request-ID and is counted
    request_context.install(app, metrics, access_log=settings.access_log)
    errors.install(app)
    app.include_router(v1_router())
    app.include_router(health.router)
    app.include_router(ui_router)  # the dashboard at /ui (static files of app/ui)
    app.include_router(docs_router)  # /docs and /redoc
    return app
