"""What the API does at start so that the first `POST /v1/jobs` answers as fast as the next ones.

A submit reads the named model's metadata (a GGUF header with its vocabulary, a config.json, a hub
snapshot's config in the Hugging Face cache), imports the modules its checks use, writes the job to
the database and sends it to the broker. The first of each used to cost seconds on a cold server
(docs/reliability.md "Submit latency"). At start: the metadata of the models already there is read into
the cache every tenant shares (app.core.services.sources.warm_configs, bounded in time and files), the check
modules are imported, a database connection is opened, and the broker's connection and the jobs' queue
are made (in a thread waited for briefly: a broker that does not answer does not hold up the start).
Torch-free."""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import text

from app.core.db import Database
from app.core.queue import queue_for
from app.core.services.sources import warm_configs
from app.core.settings import Settings

log = logging.getLogger(__name__)
# Imported by the submit checks on first use (app.core.services.model_limits, app.core.services.sources).
CHECK_MODULES = ("models.families", "models.streaming.memory_plan", "models.io.sizes", "models.layouts.layout",
                 "models.base.layout_format", "models.schedules.grammar", "huggingface_hub",
                 "huggingface_hub.file_download")


def hub_cache() -> Path | None:
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    return Path(constants.HF_HUB_CACHE)


def warm_submit(settings: Settings, queue: Any, db: Database | None = None, *, budget_s: float = 5.0,
                broker_wait_s: float = 2.0) -> dict[str, Any]:
    """The check modules imported, the models' metadata read and a database connection opened (returns
    what it did, for the log); the broker connection opened in a daemon thread, waited for up to
    `broker_wait_s`."""
    t0 = time.perf_counter()
    broker = threading.Thread(target=_open_broker, args=(queue, queue_for(settings, 1)), name="broker-warmup",
                              daemon=True)
    broker.start()
    for name in CHECK_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    files = warm_configs(settings.models_dir, hub_cache(), budget_s=budget_s)
    if db is not None:
        try:  # the pool's first connection (a TCP connect and its handshake on Postgres)
            with db.session() as session:
                session.execute(text("SELECT 1"))
        except Exception as exc:  # the submit answers 503 itself when the database is down
            log.info("submit warm-up: the database did not answer (%s: %s)", type(exc).__name__, exc)
    broker.join(timeout=broker_wait_s)  # the first submit after the start does not race it; a slow broker waits alone
    done = {"files": files, "seconds": round(time.perf_counter() - t0, 3)}
    log.info("submit warm-up: %d model metadata files read in %.2f s", files, done["seconds"])
    return done


def _open_broker(queue: Any, name: str) -> None:
    """The broker connection, and the jobs' queue declared (what the first publish would do: a table made
    on the SQLite broker), so that the first submit's send costs what the next ones' do."""
    try:
        queue.ping()
        celery = queue.celery
        with celery.producer_or_acquire() as producer:
            producer.maybe_declare(celery.amqp.queues[name])
    except Exception as exc:  # the submit answers 503 itself when the broker is down
        log.info("submit warm-up: the broker did not answer (%s: %s)", type(exc).__name__, exc)
